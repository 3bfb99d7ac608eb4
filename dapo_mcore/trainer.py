"""One DAPO run: build the pieces, then loop generate -> score/filter -> old log-probs -> update -> push.

prompts -> engine.generate (n per prompt) -> reward + overlong shaping -> dynamic-sampling filter
   ^                                                                            | (resample until full)
   |                                                                            v
engine.update_weights <- weight export (TP/PP gather -> HF names -> buckets) <- actor update
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from dapo_mcore.build import Run, build_run
from dapo_mcore.checkpoint.hf_io import SafetensorsShardWriter, write_hf_config
from dapo_mcore.checkpoint.run_checkpoint import WriterDied, read_own_file
from dapo_mcore.config import RunConfig
from dapo_mcore.config.loader import config_to_dict
from dapo_mcore.config.model_spec import load_hf_config
from dapo_mcore.data.batching import mini_batch_ranges
from dapo_mcore.data.types import Sample
from dapo_mcore.launch import (
    RECENT_STEPS,
    TIME_LIMIT_REASON,
    StoppedToResume,
    agreed,
    agreed_stop,
    cancel_grace,
    configure_stop,
    guard_forks,
    mark_saved_stop,
    no_step_fits,
    note_save,
    signalled_stop,
    stops_at_once,
    watch_time_limit,
)
from dapo_mcore.parallel import broadcast_object, destroy_parallel, on_rank0
from dapo_mcore.plan import checkpoint_bytes
from dapo_mcore.rollout.sampler import RolloutBatch
from dapo_mcore.rollout.samples_log import SAMPLES_DIR, log_step_samples
from dapo_mcore.utils.errors import CheckpointError, DapoError, MismatchError, os_reason
from dapo_mcore.utils.logging import get_logger, release_leaked_logging_locks
from dapo_mcore.utils.memory import memory_in_use_gb, release_cached_blocks
from dapo_mcore.utils.plot import plot_run
from dapo_mcore.utils.processes import Terminated
from dapo_mcore.utils.timers import PhaseTimer, note_step, phase_scope

log = get_logger(__name__)


@dataclass(frozen=True)
class TrainOutcome:
    run_dir: Path
    first_step: int  # updates done when this process started (a resume's step, else 0)
    last_step: int  # updates done when it ended


PUSH_SKIPPED = "weight_sync/skipped_for_stop"  # a step's metric: its push (and held-out check) skipped for a stop


def train(cfg: RunConfig) -> TrainOutcome:
    """Run the updates from the run's step (0, or a resume's) to cfg.trainer.steps. One convention for steps
    everywhere users see them: step N = N updates done (the console's `step N/total`, metrics.jsonl rows, the
    plots, wandb, save step_00000N, stop messages); row 0 of metrics.jsonl holds only the held-out figures of
    the weights before training. (rl_step's index and the sampler count the updates done before the one made.)"""
    configure_stop(cfg.checkpoint.save_on_signal, cfg.checkpoint.sigterm_grace_s)
    run = build_run(cfg)
    guard_forks()  # after the imports, whose at-fork hooks ours must wrap
    saved_step, step = None, 0  # the newest complete save's step (None: none), the step under way
    try:
        watch_job_end(run)
        first_step = restore(run)
        saved_step = first_step if run.resume is not None else None
        attempt_start = first_step
        push_weights(run, first=True)  # the engines sample from the actor's weights from the first step on
        with run.progress:
            run.progress.resume_at(first_step)
            if first_step == 0:
                report_held_out_before_training(run)
            for step in range(first_step + 1, cfg.trainer.steps + 1):
                stop_if_signalled(run, step - 1, saved_step, attempt_start)
                note_step(step)
                with phase_scope("step"):
                    metrics = rl_step(run, step - 1)
                if PUSH_SKIPPED not in metrics:  # (skipped for a stop: the engine holds the step's old weights)
                    metrics.update(validate(run, step))  # held out: the weights of this update
                report(run, step, metrics)
                complete_background_save(run, step)
                if should_save(cfg, step):
                    with phase_scope("save"):
                        save(run, step)
                    saved_step = step
        complete_background_save(run, cfg.trainer.steps, blocking=True)
    except StoppedToResume:
        # every rank stopped at the same boundary: end together, so that srun --kill-on-bad-exit (exit 75 is
        # not 0) rarely cuts rank 0's wandb close or lock release short (it still can during the interpreter's
        # exit: the batch script re-queues on rank 0's mark then, see launch.mark_saved_stop)
        finish(run, together=True)
        raise
    except (KeyboardInterrupt, Terminated) as stop:  # stopped at once: say what is lost and where a rerun starts
        if run.ctx.rank == 0:
            log.warning(lost_at_once_line(stop, step, saved_step))
        finish(run)
        raise
    except BaseException:
        finish(run)
        raise
    finish(run, together=True)
    return TrainOutcome(run.run_dir, first_step, max(first_step, cfg.trainer.steps))


def lost_at_once_line(stop: BaseException, step: int, saved_step: int | None) -> str:
    """One line for a run stopped at once (a second Ctrl-C, SIGTERM's grace over): what is lost and the step a
    rerun with checkpoint.resume=auto starts from. `step`: the step under way (its save included), 0 before."""
    name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else getattr(stop, "signal_name", type(stop).__name__)
    when = f"during step {step}" if step else "before the first step"
    if saved_step is None:
        return f"stopped at once by {name} {when}: no save was complete yet, so a rerun starts from step 0"
    if step <= saved_step:
        return f"stopped at once by {name} {when}: nothing is lost; checkpoint.resume=auto continues at {saved_step}"
    return (
        f"stopped at once by {name} {when}: the steps after {saved_step} are lost; checkpoint.resume=auto continues "
        f"from the save of step {saved_step}"
    )


def report_held_out_before_training(run: Run) -> None:
    """Row 0 of metrics.jsonl: the held-out figures of the weights before any update."""
    held_out = validate(run, 0)
    if held_out and run.writer is not None:
        run.writer.write(0, held_out)


def restore(run: Run) -> int:
    """Load the save this run resumes from (if any) into actor and sampler; returns its step (updates done)."""
    if run.resume is None:
        return 0
    with phase_scope("restore"):
        state = run.checkpoints.load(run.resume.path, run.actor, run.spec)
        path = run.resume.path
        # each rank reads its replica's file of the save: a refusal one of them meets is every rank's (agreed)
        agreed(lambda: run.sampler.load_state_dict(
            state["sampler"], int(state["step"]), lambda name: read_own_file(path, name), run.spec.vocab_size
        ))  # fmt: skip
    return int(state["step"])


def watch_job_end(run: Run) -> None:
    """Rank 0 under Slurm: stop and save by itself when a step and a save no longer fit before the job's end
    (launch.watch_time_limit); its stop comes out of stop_if_signalled like a signal's."""
    ck, enabled = run.cfg.checkpoint, run.cfg.checkpoint.stop_before_time_limit and run.ctx.rank == 0
    save_bytes = checkpoint_bytes(load_hf_config(run.cfg.model.hf_path), run.cfg.model.dtype) if enabled else 0
    steps_before = recent_step_times(run.run_dir) if enabled and run.resume is not None else []
    line = watch_time_limit(enabled, ck.time_limit_margin_s, save_bytes, steps_before=steps_before)
    if line:
        log.info(line)


def recent_step_times(run_dir: Path) -> list[float]:
    """time/step_s of the run's last logged steps (metrics.jsonl), for the first boundary of a resumed attempt."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    times = []
    for line in path.read_text().splitlines()[-RECENT_STEPS:]:
        try:
            seconds = json.loads(line).get("time/step_s")
        except (ValueError, AttributeError):  # a damaged line: plot and resume report it, not this
            continue
        if isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0:
            times.append(float(seconds))
    return times


def stop_if_signalled(run: Run, next_step: int, saved_step: int | None, attempt_start: int = -1) -> None:
    """At a step boundary, `next_step` updates done: when any rank got SIGUSR1 / SIGTERM / SIGINT, save what was trained
    since the newest save and raise StoppedToResume on every rank (the CLI exits 75; slurm/train.sbatch
    re-queues on it)."""
    reason = agreed_stop()
    if reason is None:
        return
    if signal_name := stops_at_once(reason):  # its KeyboardInterrupt / Terminated was dropped on some rank
        raise KeyboardInterrupt if signal_name == "SIGINT" else Terminated(signal_name)
    if next_step == attempt_start and reason.startswith(TIME_LIMIT_REASON):
        raise DapoError(no_step_fits(reason))  # exit 2: the batch script does not re-queue it
    cancel_grace()
    trained_since_save = next_step != (saved_step if saved_step is not None else 0)
    path = save(run, next_step) if trained_since_save else None
    run.checkpoints.wait()  # an async save is completed before the process ends
    log.warning("stopping after step %d on %s: %s", next_step, reason,
                f"saved to {path}" if trained_since_save else "nothing trained since the newest save")  # fmt: skip
    stop = StoppedToResume(reason, next_step, path)
    if run.ctx.rank == 0:  # the save is complete on every rank: rank 0 published it
        try:
            mark_saved_stop(stop)
        except OSError as err:  # the stop still ends in exit 75, on which the batch script re-queues too
            log.warning("could not mark the save for the batch script: %s", err)
    raise stop


def complete_background_save(run: Run, next_step: int, blocking: bool = False) -> None:
    """Complete a background save whose shards are written (blocking: wait for it). If its writer died, the
    save is lost: save now, in this process, and stop with one line naming the process (a writer that was
    killed once, by the OOM killer say, is not trusted with the next save)."""
    try:
        if blocking:
            run.checkpoints.wait()
        else:
            run.checkpoints.poll()
    except WriterDied as err:
        path = save(run, next_step, background=False)
        raise CheckpointError(
            f"{err}; saved step {next_step} here instead, to {path}: run the same command again "
            "(checkpoint.resume=auto) to continue"
        ) from None


def should_save(cfg: RunConfig, next_step: int) -> bool:
    interval = cfg.checkpoint.save_interval
    return interval > 0 and (next_step % interval == 0 or next_step == cfg.trainer.steps)


def save(run: Run, next_step: int, background: bool = True) -> Path:
    """A run checkpoint after step `next_step` (that many updates done: step_00000N), and every
    hf_export_interval saves an HF export.
    background=False: written in this process even with checkpoint.async_save."""
    start = time.perf_counter()
    run_id = run.writer.wandb_run_id if run.writer is not None else None
    state = {
        "sampler": run.sampler.state_dict(),
        "wandb_run_id": broadcast_object(run_id, src=0),
        "config": config_to_dict(run.cfg),  # a resume lists what changed since
    }
    path = run.checkpoints.save(
        next_step, run.actor, run.spec, state, background=background, own_files=run.sampler.own_files()
    )
    every = run.cfg.checkpoint.hf_export_interval * run.cfg.checkpoint.save_interval
    if every > 0 and (next_step % every == 0 or next_step == run.cfg.trainer.steps):
        export_hf(run, path)
    note_save(time.perf_counter() - start, whole=not (background and run.cfg.checkpoint.async_save))
    return path


def export_hf(run: Run, ckpt: Path) -> None:
    """<checkpoint dir>/hf/step_N: safetensors + config + tokenizer, streamed from the weight gather that
    feeds the engines (collective: every rank gathers, rank 0 writes)."""
    out = run.checkpoints.root / "hf" / ckpt.name
    writer = SafetensorsShardWriter(out.with_name(f".{out.name}.tmp")) if run.ctx.rank == 0 else None
    dtype, failure = None, None
    for name, tensor in run.exporter.hf_weights():  # every rank gathers to the end, whatever rank 0 meets
        dtype = tensor.dtype
        if writer is not None and failure is None:
            try:
                writer.add(name, tensor)
            except OSError as err:  # a full disk: reported on every rank below, not a hang
                failure = err

    def publish() -> None:
        if failure is not None:
            raise failure
        writer.close()
        write_hf_config(Path(run.cfg.model.hf_path), writer.out_dir, dtype)
        shutil.rmtree(out, ignore_errors=True)
        writer.out_dir.rename(out)
        log.info("exported HF weights to %s", out)

    on_rank0(publish, CheckpointError)


def validate(run: Run, step: int) -> dict[str, float]:
    """eval/<file>/<metric> of the held-out files after steps 0, eval_interval, 2 x eval_interval, ... and the
    last step; {} otherwise (same on every rank)."""
    interval, last = run.cfg.trainer.eval_interval, run.cfg.trainer.steps
    if run.validator is None or (step % interval != 0 and step != last):  # no validator unless interval > 0
        return {}
    if (reason := signalled_stop()) is not None:  # (came during the push) the save at the boundary goes first
        if run.ctx.rank == 0:
            log.warning("%s: the held-out check of step %d is skipped, the save follows", reason, step)
        return {}
    start = time.perf_counter()
    with engine_phase(run):
        metrics = run.validator.run()
    metrics["time/eval_s"] = time.perf_counter() - start
    k = run.cfg.trainer.eval_k
    summary = ", ".join(
        f"{key.split('/')[1]} avg@{k} {value:.3f}" for key, value in metrics.items() if key.endswith(f"/avg@{k}")
    )
    log.info("step %d: held-out %s (%.1f s)", step, summary, metrics["time/eval_s"])
    return metrics


def rl_step(run: Run, step: int) -> dict[str, float]:
    """The update after `step` updates (0-based: the sampler's seeds and the answers' weight versions count so);
    its metrics are reported as step `step + 1`."""
    timer = PhaseTimer(sync=torch.cuda.synchronize if run.ctx.device.type == "cuda" else None)
    start = time.perf_counter()
    batch, memory = rollout_phase(run, step, timer)
    write_samples(run, batch, step + 1)
    metrics = {**batch.metrics, **memory}
    if batch.groups:  # an empty batch (nothing kept at the round cap) makes no update
        metrics.update(train_phase(run, batch.samples, step, timer))
        release_cached_blocks(run.ctx.device)  # the update's activations and the step's micro-batches
        metrics["memory/after_update_gb"] = memory_in_use_gb(run.ctx.device)
        if skip_push_for_stop(run, step + 1):
            metrics[PUSH_SKIPPED] = 1.0
        else:
            with timer.phase("weight_push"):
                metrics.update(push_weights(run))
    return {**metrics, **timer.pop(), "time/step_s": time.perf_counter() - start}


def skip_push_for_stop(run: Run, step: int) -> bool:
    """After the update: when a rank got a stop signal, the save at the boundary follows next, and it needs
    neither the weight push nor the held-out check (a resume pushes the saved weights first). At the recipes'
    shapes they take from seconds (the push) to minutes (a held-out file at avg@32), beyond SIGTERM's 20 s
    grace; the step's update was then lost with them. Collective (the push is)."""
    reason = signalled_stop()
    if reason is None:
        return False
    if run.ctx.rank == 0:
        log.warning("%s during step %d: its update is done; the weight push and held-out check are skipped, "
                    "the save follows", reason, step)  # fmt: skip
    return True


def write_samples(run: Run, batch: RolloutBatch, step: int) -> None:
    """Rank 0: some of the step's answers, among those it holds, to samples/ and wandb. Optional output: a disk
    that refuses them costs a warning, not the run (the other ranks are already in the update's collectives)."""
    if run.writer is None:
        return
    tokenizer = run.sampler.tokenizer.tokenizer  # the sampler's PromptFormatter holds the HF tokenizer
    try:
        log_step_samples(batch.groups, step, run.cfg.logging.samples_per_step, tokenizer, run.run_dir / SAMPLES_DIR,
                         run.writer.log_table)  # fmt: skip
    except OSError as err:
        log.warning("step %d: the samples were not written (%s); training on", step, err)


def train_phase(run: Run, samples: list[Sample], step: int, timer: PhaseTimer) -> dict[str, float]:
    """Old log-probs (and the mismatch guard on them), then the update, on this rank's micro-batches of the
    step: built once on the device for both, and released when this returns, before the weight push wakes
    the engine's weights beside the actor (the plan's "step batch" line counts them until then)."""
    mini_batches = mini_batch_ranges(len(samples), run.cfg.trainer.mini_batch_size)
    with timer.phase("old_logprobs"):
        batches = run.actor.prepare(samples, mini_batches)
        metrics = run.actor.compute_old_logprobs(batches, step)
        if run.reference is not None:
            run.reference.logprobs_into(batches, "ref_logprobs")
    check_mismatch(run.cfg, step + 1, metrics)
    with timer.phase("update"):
        metrics.update(run.actor.train_step(batches, step + 1))
    return metrics


def check_mismatch(cfg: RunConfig, step: int, metrics: dict[str, float]) -> None:
    """The guard against a broken weight push: the engine's log-probs of the answers it sampled with this
    step's weights should be the actor's up to numerics (bf16: a KL of thousandths of a nat a token); a KL of
    tenths or more means the engine generated with other weights (or has drifted far from the actor). Stops
    (or warns) with one line naming the step and the gap (the metrics are the same on every rank, so every
    rank stops alike)."""
    mm = cfg.algorithm.mismatch
    kl = metrics.get("mismatch/k3_kl")
    if mm.guard == "off" or kl is None or kl <= mm.guard_max_kl:
        return
    if math.isnan(kl):
        message = (
            f"step {step}: a log-prob of the answers the engine just sampled is not a number (NaN), the actor's or "
            "the engine's: the KL between them cannot be told (mismatch/k3_kl is NaN)"
        )
    else:
        message = (
            f"step {step}: the engine's log-probs of the answers it just sampled are far from the actor's: KL(engine "
            f"|| actor) {kl:.3g} nats a token (mismatch/k3_kl > algorithm.mismatch.guard_max_kl={mm.guard_max_kl:g}; "
            f"mean |log-prob gap| {metrics['mismatch/abs_logp_diff_mean']:.3g}): the engine did not generate with "
            "the actor's weights (a broken weight push?)"
        )
    if mm.guard == "warn":
        log.warning("%s; training on (algorithm.mismatch.guard=warn)", message)
        return
    raise MismatchError(f"{message}; stopped (algorithm.mismatch.guard=stop; rollout.verify_weights=true checks "
                        "every push's checksums)")  # fmt: skip


def rollout_phase(run: Run, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
    """Hand the accelerator to the engine, generate the step's batch, hand it back to the actor; the memory in
    use at each hand-over point is returned as metrics."""
    device = run.ctx.device
    memory = {"memory/step_start_gb": memory_in_use_gb(device)}
    with engine_phase(run):
        batch = run.sampler.next_batch(step, timer, on_round=run.progress.round_done)
        memory["memory/after_generate_gb"] = memory_in_use_gb(device)
    memory["memory/engine_released_gb"] = memory_in_use_gb(device)
    return batch, memory


@contextmanager
def engine_phase(run: Run) -> Iterator[None]:
    """The engine holds its memory (KV cache, weights) inside; the actor gets it back after."""
    offload = run.cfg.rollout.offload_actor
    if offload:
        run.actor.offload_for_rollout()
    run.engine.resume_memory()
    yield
    run.engine.release_memory()
    if offload:
        run.actor.restore_after_rollout()


def push_weights(run: Run, first: bool = False) -> dict[str, float]:
    """The actor's weights to the engine; with rollout.verify_weights (and, by default, on a run's first push:
    rollout.verify_first_push), a line and metrics say what was checked (a mismatch stops the run with one
    line naming the tensor). Later pushes are watched by the mismatch guard (check_mismatch)."""
    verify = run.cfg.rollout.verify_weights or (first and run.cfg.rollout.verify_first_push)
    start = time.perf_counter()
    stats = run.exporter.push(run.engine, verify=verify)
    if not verify:
        return {}
    log.info("weight push verified: %d tensors (%.1f MiB) taken by the engine match the actor's checksums (%.2f s)",
             stats.tensors, stats.nbytes / 2**20, time.perf_counter() - start)  # fmt: skip
    return {"weight_sync/verified_tensors": float(stats.tensors), "weight_sync/verified_mib": stats.nbytes / 2**20}


def report(run: Run, step: int, metrics: dict[str, float]) -> None:
    run.progress.step_done(step, metrics)
    if run.writer is None:
        return
    run.writer.write(step, metrics)
    interval = run.cfg.logging.plot_interval
    if run.cfg.logging.plot and interval > 0 and step % interval == 0:
        draw_curves(run)


def draw_curves(run: Run) -> None:
    """curves.png from metrics.jsonl (rank 0). Optional output: a disk that refuses it costs a warning, not the
    run; in finish() its OSError skipped the closing of the engine and the verifier workers, and the process
    printed a traceback and never exited."""
    png = run.run_dir / "curves.png"
    try:
        plot_run(run.writer.path, png, title=run.cfg.name)
    except OSError as err:
        log.warning("the curves were not drawn to %s (%s)", png, os_reason(err))


def finish(run: Run, together: bool = False) -> None:
    """Close everything the run opened. `together`: every rank is here (a normal end, a stop on a signal),
    so the ranks wait for each other before leaving; not after a failure, where a rank may be gone."""
    if release_leaked_logging_locks():  # a signal landed inside a logging call: wandb's thread would wait on it
        log.warning("a signal landed inside a logging call; its lock is released")
    if run.writer is not None:
        if run.cfg.logging.plot and run.writer.path.exists():
            draw_curves(run)
        run.writer.close()
    run.verifiers.close()
    if run.lock is not None:
        run.lock.release()
    if together:  # before the engine's shutdown, which may end the default group (vLLM at engine TP > 1)
        torch.distributed.barrier()
    run.engine.shutdown()
    destroy_parallel()
