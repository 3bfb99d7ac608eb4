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

    python tools/bench_partial_rollout.py --replicas 1 2 4 8 [--step-ms 10] [--steps 4] [--turns 3] ...

Replicas at scale, on a machine of a few cores: threads stand in for the ranks of `--replicas` engine replicas
(engine TP 1), each running the real sampler (RolloutSampler: its round loop, QuotaStopper, RoundControl,
verifier, all-gather and exchange) over a simulated engine whose every step advances each answer one token and
takes `--step-ms` whatever the batch holds (a GPU's decode step is memory-bound); answers are drawn from a long
tail (one in eight runs on for 60-220 tokens, the rest end within 40) and are right with a per-problem accuracy
(some problems always solved, some never: dynamic sampling filters those). Three samplers take turns at each
replica count: synchronous (every answer to its end), partial rollout with each replica stopping at its own
share of the step's groups (ceil(wanted / replicas), the rule before rollout/agreement.py), and partial
rollout with the global stop (the replicas add their kept groups to one count on a shared board). Prints
kept groups/s, the rounds' wall time and the ratios to the synchronous sampler at the same replica count.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import re
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from dapo_mcore.rollout.agreement import LocalBoard
from dapo_mcore.rollout.base import AnswerRequest, Completion, SamplingParams, step_poll
from dapo_mcore.rollout.partial import RoundStats, partial_metrics

REPO = Path(__file__).resolve().parents[1]


def sampler_settings(args, partial: bool):
    from dapo_mcore.rollout.sampler import SamplerSettings

    return SamplerSettings(
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


def make_sampler(engine, tokenizer, args, partial: bool):
    from dapo_mcore.data.arithmetic import ArithmeticTask
    from dapo_mcore.data.datasets import PromptStream
    from dapo_mcore.rewards.pool import VerifierPool
    from dapo_mcore.rollout.sampler import RolloutSampler

    return RolloutSampler(
        engine, tokenizer, PromptStream(ArithmeticTask(0, 29, "+"), seed=args.seed),
        VerifierPool("dapo", workers=0).verify, sampler_settings(args, partial), rank=0, world_size=1,
        all_gather=lambda obj: [obj],
    )  # fmt: skip


class Tally:
    """One sampler's steps: rollout seconds, kept groups and their (trained) response tokens."""

    def __init__(self):
        self.seconds = self.groups = self.tokens = 0.0
        self.steps = self.rounds = 0

    def add(self, batch, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1
        self.rounds += int(batch.metrics["dynamic_sampling/rounds"])
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


# --- simulated replicas (--replicas) ---

FILLER = 5  # the token of an answer's body; its first two tokens carry its length and correctness
ACCURACIES = (0.0, 0.0, 1.0, 1.0, 0.2, 0.4, 0.6, 0.8)  # a problem's chance of a right answer, by its hash
SAMPLERS = ("synchronous", "partial, own share", "partial, global stop")


class CharTokenizer:
    """Characters as token ids, so that the simulated engine reads the problem back from the prompt's ids."""

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[ord(c) for c in text])


@dataclass(frozen=True)
class LongTail:
    """Answer lengths: `long_share` of answers run on for `long` tokens, the rest end within `short`."""

    short: tuple[int, int] = (8, 40)
    long: tuple[int, int] = (60, 220)
    long_share: float = 0.125

    def length(self, rng: random.Random) -> int:
        return rng.randint(*(self.long if rng.random() < self.long_share else self.short))


@dataclass
class PlannedAnswer:
    """What one request generates if its round runs until it ends."""

    new_tokens: list[int]
    finish_reason: str
    text: str

    def after(self, steps: int) -> Completion:
        """The completion after `steps` engine steps: whole once they cover it, else cut ("abort")."""
        if steps >= len(self.new_tokens):
            return Completion(self.new_tokens, [0.0] * len(self.new_tokens), self.finish_reason, self.text)
        return Completion(self.new_tokens[:steps], [0.0] * steps, "abort", "")


def problem_accuracy(prompt_ids: list[int]) -> float:
    return ACCURACIES[zlib.crc32(bytes(i % 256 for i in prompt_ids)) % len(ACCURACIES)]


def answer_text(prompt_ids: list[int], correct: bool) -> str:
    a, b = map(int, re.findall(r"\d+", "".join(map(chr, prompt_ids)))[:2])  # "What is a+b?"
    return f"Answer: {a + b if correct else a + b + 1}"


class SimulatedEngine:
    """One replica's engine: each step advances every unfinished answer by one token and takes `step_s`,
    whatever the batch holds. An answer's length and correctness are drawn from its request's seed when it
    begins and written into its first two tokens, so that a continued answer keeps them."""

    def __init__(self, workload: LongTail, step_s: float):
        self.workload, self.step_s = workload, step_s

    def plan(self, prompt_ids: list[int], prefix: tuple[int, ...], budget: int, rng: random.Random) -> PlannedAnswer:
        if prefix:
            length, correct = prefix[0], bool(prefix[1])
        else:
            length, correct = self.workload.length(rng), rng.random() < problem_accuracy(prompt_ids)
        whole = [length, int(correct)] + [FILLER] * (length - 2)
        new = whole[len(prefix) : len(prefix) + budget]
        ended = len(prefix) + len(new) == length
        return PlannedAnswer(new, "stop" if ended else "length", answer_text(prompt_ids, correct) if ended else "")

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        rng = random.Random(params.seed)
        groups = [[self.plan(ids, (), params.max_new_tokens, rng) for _ in range(params.n)] for ids in prompt_ids]
        longest = max((len(a.new_tokens) for group in groups for a in group), default=0)
        for _ in range(longest):
            time.sleep(self.step_s)
        return [[a.after(longest) for a in group] for group in groups]

    def generate_answers(self, requests: list[AnswerRequest], params: SamplingParams, on_finished) -> list:
        answers = [self.plan(r.prompt_ids, r.answer_prefix, r.max_new_tokens, random.Random(r.seed)) for r in requests]
        ending: dict[int, list[int]] = {}
        for i, answer in enumerate(answers):
            ending.setdefault(len(answer.new_tokens), []).append(i)
        poll, step = step_poll(on_finished), 0
        while step < max(ending, default=0):
            step += 1
            time.sleep(self.step_s)
            stop = False
            for i in ending.get(step, ()):
                stop = bool(on_finished(i, answers[i].after(step))) or stop
            if stop or poll():
                break
        return [a.after(step) for a in answers]


class ThreadRanks:
    """The collectives of `size` threads standing in for ranks: the sampler's all_gather and its exchange's
    all-to-all (rollout/exchange.py Transport)."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=600), [None] * size

    def all_gather(self, rank: int, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before any writes the next call's
        return gathered

    def all_to_all(self, rank: int, send: torch.Tensor, send_words: list[int], recv_words: list[int]) -> torch.Tensor:
        parts = self.all_gather(rank, send.split(send_words))
        return torch.cat([parts[source][rank] for source in range(self.size)])


class OwnShareBoard(LocalBoard):
    """One replica's board, alone: its kept groups counted `replicas` times, so that the round's count reaches
    `wanted` once this replica alone keeps ceil(wanted / replicas): the stop before rollout/agreement.py."""

    def __init__(self, replicas: int):
        super().__init__()
        self.replicas = replicas

    def add(self, key: str, amount: int) -> int:
        return super().add(key, amount) * self.replicas


@dataclass
class ReplicaRun:
    """One sampler per replica (engine TP 1: a rank each), its engine's slot counter, their collectives."""

    samplers: list
    counters: list[SlotCounter]
    ranks: ThreadRanks


def replica_run(name: str, replicas: int, args: argparse.Namespace) -> ReplicaRun:
    from dapo_mcore.data.arithmetic import ArithmeticTask
    from dapo_mcore.data.datasets import PromptStream
    from dapo_mcore.rewards.pool import VerifierPool
    from dapo_mcore.rollout.sampler import RolloutSampler

    ranks, shared = ThreadRanks(replicas), LocalBoard()
    samplers, counters = [], []
    for rank in range(replicas):
        counters.append(SlotCounter(SimulatedEngine(LongTail(), args.step_ms / 1000)))
        samplers.append(RolloutSampler(
            counters[-1], CharTokenizer(), PromptStream(ArithmeticTask(0, 29, "+"), seed=args.seed),
            VerifierPool("dapo", workers=0).verify, sampler_settings(args, name != "synchronous"), rank=rank,
            world_size=replicas, all_gather=functools.partial(ranks.all_gather, rank),
            exchange=functools.partial(ranks.all_to_all, rank),
            board=OwnShareBoard(replicas) if name == "partial, own share" else shared,
        ))  # fmt: skip
    return ReplicaRun(samplers, counters, ranks)


def step_together(run: ReplicaRun, step: int) -> tuple[object, float]:
    """One step of every replica's sampler, each in its thread; rank 0's batch and the step's wall time."""
    from dapo_mcore.utils.timers import PhaseTimer

    batches, errors = [None] * len(run.samplers), []

    def one_rank(rank: int) -> None:
        try:
            batches[rank] = run.samplers[rank].next_batch(step, PhaseTimer())
        except BaseException as err:  # the others wait in a collective: release them, then report
            errors.append(err)
            run.ranks.barrier.abort()

    start = time.perf_counter()
    threads = [threading.Thread(target=one_rank, args=(rank,), daemon=True) for rank in range(len(run.samplers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return batches[0], time.perf_counter() - start


def bench_replica_count(replicas: int, args: argparse.Namespace) -> list[dict]:
    """The three samplers at `replicas` replicas, in turns; one row each."""
    runs = {name: replica_run(name, replicas, args) for name in SAMPLERS}
    tallies = {name: Tally() for name in SAMPLERS}
    for turn in range(args.turns):
        for name, run in runs.items():
            for k in range(args.steps):
                tallies[name].add(*step_together(run, turn * args.steps + k))
    rows = []
    for name, run in runs.items():
        stats = [s for counter in run.counters for s in counter.stats]
        row = tallies[name].row(name, partial_metrics(stats, 0, 0, 0)["rollout/slot_utilization"])
        rows.append(row | {"replicas": replicas, "rounds": tallies[name].rounds})
    return rows


def bench_replicas(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the replicas' threads share the machine's cores
    print(f"simulated engine replicas {args.replicas}: {args.step_ms:g} ms per decode step; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{args.turns} turns x {args.steps} steps; {args.prompts_per_step} groups/step of {args.n}, "
          f"{args.gen_prompts} prompts/round, max {args.max_new} new tokens\n")  # fmt: skip
    print("| replicas | sampler | steps | rounds | rollout s | s per round | kept groups/s | x sync | slot use |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for replicas in args.replicas:
        rows = bench_replica_count(replicas, args)
        sync = rows[0]["kept groups/s"]
        for r in rows:
            print(f"| {r['replicas']} | {r['sampler']} | {r['steps']} | {r['rounds']} | {r['rollout s']:.1f} | "
                  f"{r['rollout s'] / r['rounds']:.2f} | {r['kept groups/s']:.2f} | "
                  f"x{r['kept groups/s'] / sync:.2f} | {r['slot utilisation']:.2f} |", flush=True)  # fmt: skip


def parse_args() -> argparse.Namespace:
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
    ap.add_argument("--replicas", type=int, nargs="+", help="simulated engine replicas (threads), e.g. 1 2 4 8")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the simulated engine's decode step")
    args = ap.parse_args()
    if args.replicas and min(args.replicas) < 1:
        ap.error("--replicas: each count must be at least 1")
    return args


def bench_engine(args: argparse.Namespace) -> None:
    """The synchronous and the partial sampler on one real engine (hf or vllm), in turns."""
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


def main() -> None:
    args = parse_args()
    if args.replicas:
        bench_replicas(args)
    else:
        bench_engine(args)


if __name__ == "__main__":
    main()
