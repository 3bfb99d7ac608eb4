#!/usr/bin/env python
"""The bytes and time of one generation round's data movement between ranks, at the DAPO paper's shape.

    python tools/bench_rollout_data.py [--world 2] [--scale 0.125] [--repeats 3]

Synthetic groups stand in for what the engines return: the paper's round of 1536 prompts (3 x 512) x 16
answers, prompts of 256 tokens, answer lengths log-normal (median 2,000, capped at 20,480 tokens), token ids
below 152,064 (Qwen2.5's vocabulary), one kept group in three (the over-sampling the 3x round is sized for).
Each of --world gloo processes holds its replica's share. Two ways, taking turns --repeats times, in the same
run:
  objects   the previous data path: every generated group, token ids and log-probs as Python lists,
            pickled and all-gathered to every rank (torch.distributed.all_gather_object);
  tensors   rollout/exchange.py: a summary of every group all-gathered as objects (verdicts, rewards,
            lengths), then the kept groups' token ids and log-probs as one int32 tensor per replica
            (one all-gather of padded tensors), unpacked into samples holding tensor views.
--scale < 1 generates that fraction of the round (memory: the objects way holds every token of the round as
Python objects on every rank, about 70 bytes a token); bytes and times are then reported for the whole round
by dividing by it (both ways are linear in the tokens). Prints a markdown table; bytes are what one rank
receives.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS, ANSWERS, PROMPT_LEN, VOCAB, MAX_LEN, KEEP_EVERY = 1536, 16, 256, 152064, 20480, 3


def synthetic_groups(replica: int, n_replicas: int, scale: float):
    """This replica's share of the round, scored: (groups, keep flags)."""
    import torch

    from dapo_mcore.data.types import Group, Prompt, Sample

    g = torch.Generator().manual_seed(1234 + replica)
    n_prompts = round(PROMPTS * scale)
    groups, keep = [], []
    for i in range(replica, n_prompts, n_replicas):
        prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist()
        lengths = torch.empty(ANSWERS).log_normal_(mean=7.6, std=0.8, generator=g).clamp(1, MAX_LEN).long().tolist()
        samples = [
            Sample(
                prompt_ids=prompt,
                response_ids=torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(n, generator=g)).tolist(),
                finish_reason="length" if n == MAX_LEN else "stop",
                response_text="",
                correct=bool(j % 2),
                reward=1.0 if j % 2 else -1.0,
            )
            for j, n in enumerate(lengths)
        ]
        groups.append(Group(Prompt(f"problem {i}", "42", str(i)), samples))
        keep.append(i % KEEP_EVERY == 0)
    return groups, keep


def pickled_bytes(shares) -> int:
    return sum(len(pickle.dumps(share, protocol=pickle.HIGHEST_PROTOCOL)) for share in shares)


def objects_way(groups, _keep, _replica, _n):
    """The previous data path: every generated group, as Python objects, to every rank. Returns a function
    giving the bytes this rank received (counted after the timing)."""
    from dapo_mcore.parallel import all_gather_objects

    gathered = all_gather_objects(groups)
    return lambda: pickled_bytes(gathered)


def tensors_way(groups, keep, replica, n_replicas):
    """rollout/exchange.py: summaries to every rank, the kept groups' tokens once as tensors."""
    import torch

    from dapo_mcore.parallel import all_gather_objects, all_gather_padded
    from dapo_mcore.rollout.exchange import fetch_groups, summarize

    keys = [(0, i) for i in range(len(groups))]
    summaries = [summarize(g, k, replica, key) for g, k, key in zip(groups, keep, keys)]
    gathered = all_gather_objects(summaries)
    every = [s for share in gathered for s in share]
    kept = [s for s in every if s.keep]
    sent = []

    def gather(tensor, length):
        sent.append(length * tensor.element_size())
        return all_gather_padded(tensor, length, torch.device("cpu"))

    fetch_groups(kept, dict(zip(keys, groups)), replica, n_replicas, 1, gather)
    return lambda: pickled_bytes(gathered) + n_replicas * sum(sent)


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups, keep = synthetic_groups(rank, world, args.scale)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
    results = {"objects": [], "tensors": []}
    ways = {"objects": objects_way, "tensors": tensors_way}
    for _ in range(args.repeats):
        for name, way in ways.items():  # taking turns: a shared host's changing load hits both alike
            dist.barrier()
            start = time.perf_counter()
            received = way(groups, keep, rank, world)
            dist.barrier()
            results[name].append((time.perf_counter() - start, received()))
    totals = [None] * world
    dist.all_gather_object(totals, tokens)
    if rank == 0:
        print(json.dumps({"results": results, "tokens": sum(totals)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--scale", type=float, default=0.125)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world), "--master_port",
           "29517", __file__, "--worker", "--scale", str(args.scale), "--repeats", str(args.repeats)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, world {args.world} (gloo), "
          f"{report['tokens'] / args.scale / 1e6:.0f}M tokens a round (measured at scale {args.scale})\n")  # fmt: skip
    print("| way | received per rank, a round | time, a round (median) | vs objects |")
    print("|---|---|---|---|")
    medians = {}
    for name, runs in report["results"].items():
        times = sorted(t for t, _ in runs)
        medians[name] = times[len(times) // 2] / args.scale
        received = runs[0][1] / args.scale
        ratio = medians["objects"] / medians[name]
        print(f"| {name} | {received / 2**30:.2f} GiB | {medians[name]:.1f} s | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
