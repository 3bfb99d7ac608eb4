#!/usr/bin/env python
"""Partial rollout against the synchronous sampler on a long-tail workload, in the same run, in turns.

    python tools/bench_partial_rollout.py [--model examples/models/tiny-arith-longtail] [--engine hf]
        [--steps 4] [--turns 3] [--prompts-per-step 16] [--gen-prompts 32] [--n 8] [--max-new 224]

The workload: the long-tail demo model (tools/make_tiny_model.py --long-tail: one answer in eight runs on for
60-200 tokens, the rest end within 40) on arithmetic prompts, with DAPO's dynamic sampling. Two samplers, the
paper's synchronous one and rollout.partial_rollout, draw from the same engine (weights fixed: only the
rollout is measured) and take turns: each turn runs `--steps` steps of one, then of the other, so that
whatever else the machine does falls on both. Per sampler: kept groups per second and trained (batch) tokens
per second of rollout time, and the engine's slot utilisation (the share of answer x decode-step slots that
produced a token). Prints a markdown table with the partial sampler's ratios to the synchronous one.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from dapo_mcore.rollout.partial import RoundStats, partial_metrics

REPO = Path(__file__).resolve().parents[1]


def make_sampler(engine, tokenizer, args, partial: bool):
    from dapo_mcore.data.arithmetic import ArithmeticTask
    from dapo_mcore.data.datasets import PromptStream
    from dapo_mcore.rewards.pool import VerifierPool
    from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings

    settings = SamplerSettings(
        n_samples_per_prompt=args.n,
        prompts_per_step=args.prompts_per_step,
        gen_prompts_per_round=args.gen_prompts,
        temperature=1.0,
        top_p=1.0,
        max_response_len=args.max_new,
        seed=args.seed,
        max_rounds=8,
        partial_rollout=partial,
    )
    return RolloutSampler(
        engine, tokenizer, PromptStream(ArithmeticTask(0, 29, "+"), seed=args.seed),
        VerifierPool("dapo", workers=0).verify, settings, rank=0, world_size=1, all_gather=lambda obj: [obj],
    )  # fmt: skip


class Tally:
    """One sampler's steps: rollout seconds, kept groups and their (trained) response tokens."""

    def __init__(self):
        self.seconds = self.groups = self.tokens = 0.0
        self.steps = 0

    def add(self, batch, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1
        self.groups += len(batch.groups)
        self.tokens += sum(s.response_len for g in batch.groups for s in g.samples)

    def row(self, name: str, utilisation: float) -> dict:
        return {
            "sampler": name,
            "steps": self.steps,
            "rollout s": self.seconds,
            "kept groups/s": self.groups / self.seconds,
            "trained tokens/s": self.tokens / self.seconds,
            "slot utilisation": utilisation,
        }


class SlotCounter:
    """Wraps the engine: records each call's RoundStats for one sampler, so that both samplers' slot
    utilisation is computed as the partial sampler's metric is (rollout/partial.py: partial_metrics)."""

    def __init__(self, engine):
        self.engine, self.stats = engine, []

    def generate(self, prompt_ids, params):
        groups = self.engine.generate(prompt_ids, params)
        answers = [c for g in groups for c in g]
        self.stats.append(RoundStats(len(answers), 0, sum(len(c.token_ids) for c in answers),
                                     max((len(c.token_ids) for c in answers), default=0)))  # fmt: skip
        return groups

    def generate_answers(self, requests, params, on_finished):
        answers = self.engine.generate_answers(requests, params, on_finished)
        self.stats.append(RoundStats.of(requests, answers))
        return answers

    def utilisation(self) -> float:
        return partial_metrics(self.stats, 0, 0, 0)["rollout/slot_utilization"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "examples/models/tiny-arith-longtail"))
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--steps", type=int, default=4, help="steps of each sampler per turn")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--gen-prompts", type=int, default=32, help="prompts per round (the paper: 3x per step)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=224)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from dapo_mcore.data.templates import PromptFormatter
    from dapo_mcore.rollout.base import EngineSettings
    from dapo_mcore.rollout.registry import create_engine
    from dapo_mcore.utils.timers import PhaseTimer

    engine = create_engine(args.engine, EngineSettings(model_path=args.model))
    tokenizer = PromptFormatter(AutoTokenizer.from_pretrained(args.model))
    counters = {name: SlotCounter(engine) for name in ("synchronous", "partial")}
    samplers = {name: make_sampler(counters[name], tokenizer, args, name == "partial") for name in counters}
    tallies = {name: Tally() for name in samplers}
    for turn in range(args.turns):
        for name, sampler in samplers.items():
            for k in range(args.steps):
                step = turn * args.steps + k
                start = time.perf_counter()
                batch = sampler.next_batch(step, PhaseTimer())
                tallies[name].add(batch, time.perf_counter() - start)
        print(f"turn {turn + 1}/{args.turns} done", flush=True)
    rows = [tallies[name].row(name, counters[name].utilisation()) for name in samplers]
    print(f"\n{args.engine} engine, {Path(args.model).name}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.turns} turns x {args.steps} steps; "
          f"{args.prompts_per_step} groups/step of {args.n}, {args.gen_prompts} prompts/round, "
          f"max {args.max_new} new tokens\n")  # fmt: skip
    print("| sampler | steps | rollout s | kept groups/s | trained tokens/s | slot utilisation |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['sampler']} | {r['steps']} | {r['rollout s']:.1f} | {r['kept groups/s']:.2f} | "
              f"{r['trained tokens/s']:.0f} | {r['slot utilisation']:.2f} |")  # fmt: skip
    sync, part = rows
    print(f"\npartial / synchronous: kept groups/s x{part['kept groups/s'] / sync['kept groups/s']:.2f}, "
          f"trained tokens/s x{part['trained tokens/s'] / sync['trained tokens/s']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
