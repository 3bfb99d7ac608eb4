"""One DAPO run: build the pieces, then loop generate -> score/filter -> old log-probs -> update -> push.

prompts -> engine.generate (n per prompt) -> reward + overlong shaping -> dynamic-sampling filter
   ^                                                                            | (resample until full)
   |                                                                            v
engine.update_weights <- weight export (TP/PP gather -> HF names -> buckets) <- actor update
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dapo_mcore.build import Run, build_run
from dapo_mcore.config import RunConfig
from dapo_mcore.parallel import destroy_parallel
from dapo_mcore.utils.plot import plot_run
from dapo_mcore.utils.timers import PhaseTimer


def train(cfg: RunConfig) -> Path:
    """Run cfg.trainer.steps RL steps; returns the run directory."""
    run = build_run(cfg)
    try:
        run.exporter.push(run.engine)  # the engines sample from the actor's weights from step 0 on
        with run.progress:
            for step in range(cfg.trainer.steps):
                report(run, step, rl_step(run, step))
    finally:
        finish(run)
    return run.run_dir


def rl_step(run: Run, step: int) -> dict[str, float]:
    timer = PhaseTimer(sync=torch.cuda.synchronize if run.ctx.device.type == "cuda" else None)
    start = time.perf_counter()
    run.engine.resume_memory()
    batch = run.sampler.next_batch(step, timer, on_round=run.progress.round_done)
    run.engine.release_memory()
    metrics = dict(batch.metrics)
    samples = batch.samples
    if samples:  # an empty batch (nothing kept at the round cap) makes no update
        mini_batches = split_mini_batches(len(samples), run.cfg.trainer.mini_batch_size)
        with timer.phase("old_logprobs"):
            metrics.update(run.actor.compute_old_logprobs(samples, mini_batches, step))
            if run.reference is not None:
                run.reference.fill_logprobs(samples, mini_batches, "ref_logprobs")
        with timer.phase("update"):
            metrics.update(run.actor.train_step(samples, mini_batches))
        with timer.phase("weight_push"):
            run.exporter.push(run.engine)
    return {**metrics, **timer.pop(), "time/step_s": time.perf_counter() - start}


def split_mini_batches(n_samples: int, mini_batch_size: int) -> list[list[int]]:
    """Consecutive index ranges of at most mini_batch_size samples: one optimizer update each."""
    return [list(range(i, min(i + mini_batch_size, n_samples))) for i in range(0, n_samples, mini_batch_size)]


def report(run: Run, step: int, metrics: dict[str, float]) -> None:
    run.progress.step_done(step, metrics)
    if run.writer is None:
        return
    run.writer.write(step, metrics)
    interval = run.cfg.logging.plot_interval
    if interval > 0 and (step + 1) % interval == 0:
        plot_run(run.writer.path, run.run_dir / "curves.png", title=run.cfg.name)


def finish(run: Run) -> None:
    if run.writer is not None:
        if run.writer.path.exists():
            plot_run(run.writer.path, run.run_dir / "curves.png", title=run.cfg.name)
        run.writer.close()
    run.verifiers.close()
    run.engine.shutdown()
    destroy_parallel()
