"""Run checkpoints: the whole state of a run in one Megatron-Core distributed checkpoint per save.

    <dir>/step_000012/            one save, after step 12 (12 updates done)
        ... dist_checkpointing files: "model" and "optimizer" sharded, per-rank "rng";
            in the common state the LR schedule, the run state (data position, dynamic-sampling state and
            carried-over groups, logger run id) and "format" (model spec, layout saved at, step)
        hf_assets/                config.json and tokenizer files, for exports
        rollout_pending/          partial rollout's unfinished groups, a file per engine replica that holds
                                  some (written by that replica; its records are in the run state)
        MANIFEST.json             written last: every file with its size; a save without it is incomplete
    <dir>/latest                  the name of the newest complete save, moved only after MANIFEST.json

Saves are atomic: written as `.step_000012.tmp`, renamed once every rank has finished, then `latest` is
rewritten (by a rename, too). The last `keep_last` saves are kept. Loading checks the manifest first (missing
file, truncated file, missing metadata), so a save cut short by a killed job is reported and skipped by
`resume=auto` instead of failing halfway through loading weights.

The model is stored layout-free (sharded tensors keyed by global layer index): it loads at any TP x PP x DP
(x EP) layout. The distributed optimizer's state is stored as `checkpoint.optimizer_format` says
(checkpoint/optimizer_format.py; by default each rank's own share, which reloads at another data-parallel size).
Per-rank RNG states are restored only at the same layout. The processes behind Megatron's writes die with the run
(checkpoint/writer_processes.py).
"""

from __future__ import annotations

import functools
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dapo_mcore.checkpoint.model_checkpoint import (
    atomic_write,
    check_model_spec,
    copy_hf_assets,
    dir_bytes,
    file_crc32,
    format_record,
    model_sharded_state_dict,
    read_common,
    read_manifest,
    verify_complete,
    write_manifest,
)
from dapo_mcore.checkpoint.optimizer_format import (
    BEFORE_FORMATS,
    adam_step_fixed,
    allocate_optimizer_state,
    optimizer_state,
    refuse_other_layout,
)
from dapo_mcore.checkpoint.writer_processes import (
    dead_writer_manager,
    forked_writers_die_with_us,
    restart_writer_manager,
    writer_results_queue_dies_with_us,
)
from dapo_mcore.config.model_spec import ModelSpec
from dapo_mcore.mcore.mcore_compat import save_in_background, sync_offloaded_optimizer_after_load
from dapo_mcore.mcore.sharding import unwrap
from dapo_mcore.parallel.state import ParallelContext, all_gather_objects, broadcast_object, on_rank0
from dapo_mcore.rollout.pending import listed_files
from dapo_mcore.utils.errors import CheckpointError
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)

LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _rng_object(ctx: ParallelContext) -> Any:
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"cpu": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if ctx.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    shape, rank = (ctx.pp_size, ctx.tp_size, ctx.dp_size), (ctx.pp_rank, ctx.tp_rank, ctx.dp_rank)
    if ctx.cp_size > 1:  # CP peers hold RNG states of their own: a shard each (CP 1 keeps the saves' old form)
        shape, rank = (ctx.pp_size, ctx.tp_size, ctx.cp_size, ctx.dp_size), (*rank[:2], ctx.cp_rank, ctx.dp_rank)
    return ShardedObject("rng_state", state, shape, rank, replica_id=0)


def sharded_structure(state: dict[str, Any]) -> str:
    """A fingerprint of what a save's sharded state holds (each shard's key, global shape and offset, replica,
    flattened range and dtype), not of its values: equal fingerprints, equal save distributions."""
    import hashlib

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    fields = ("key", "global_shape", "global_offset", "replica_id", "flattened_range", "dtype", "axis_fragmentations")
    shards = sorted(
        repr([getattr(v, name, None) for name in fields] + [tuple(getattr(getattr(v, "data", None), "shape", ()))])
        for v in nested_values(state)
        if isinstance(v, ShardedBase)
    )
    return hashlib.sha256("\n".join(shards).encode()).hexdigest()


def layout_of(ctx: ParallelContext) -> dict[str, int]:
    return layout_for(ctx.tp_size, ctx.pp_size, ctx.vpp_size, ctx.dp_size, ctx.ep_size, ctx.etp_size, ctx.cp_size)


def layout_for(tp: int, pp: int, vpp: int, dp: int, ep: int = 1, etp: int = 0, cp: int = 1) -> dict[str, int]:
    """A layout as a save records it (etp 0: the same as tp; dp without CP); `check` computes the one a job will
    have. A record without "cp" is CP 1."""
    layout = {"tp": tp, "pp": pp, "vpp": vpp, "dp": dp}
    if ep > 1 or (etp or tp) != tp:  # (a dense model's layout reads as before)
        layout.update(ep=ep, etp=etp or tp)
    if cp > 1:  # (as ep: a save at CP 1, or one made before CP, reads as before)
        layout["cp"] = cp
    return layout


class WriterDied(CheckpointError):
    """A background save was lost: its writer process, or the manager behind its results queue, died."""


def _fate(process: Any) -> str:
    code = process.exitcode
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class CheckpointManager:
    def __init__(
        self,
        root: str | Path,
        ctx: ParallelContext,
        keep_last: int = 2,
        hf_assets_from: str = "",
        async_save: bool = False,
        optimizer_format: str = "dp_reshardable",
    ):
        self.root, self.ctx, self.keep_last, self.hf_assets_from = Path(root), ctx, keep_last, hf_assets_from
        self.optimizer_format = optimizer_format
        writer_results_queue_dies_with_us()
        forked_writers_die_with_us()
        self._async_queue = None
        self._writing: tuple[Path, Path] | None = None  # a background save's (tmp, final) until it completes
        self._save_wrapper: Any = None  # Megatron's fully parallel save strategy, kept for its cached distribution
        self._saved_structure = ""  # the fingerprint of the sharded state the cached distribution was made for
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = AsyncCallsQueue()

    # ----- saving -----------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        actor: Any,
        spec: ModelSpec,
        run_state: dict[str, Any],
        background: bool = True,
        own_files: dict[str, Any] | None = None,
    ) -> Path:
        """Save after step `step` (that many updates done: step_00000N). Collective over all ranks.
        `own_files`: name -> object this rank alone writes into the save (torch.save; names unique across ranks).

        With async_save (and background), the shards are written by a background process while training goes
        on; the save becomes complete (manifest, rename, `latest`) in a later `poll()` or `wait()`. One save at
        a time."""
        from megatron.core import dist_checkpointing

        try:
            self.wait()
        except WriterDied as err:  # this save replaces the one lost
            log.error("%s; saving step %d now", err, step)
        start = time.perf_counter()
        final, tmp = self.root / step_dir_name(step), self.root / f".{step_dir_name(step)}.tmp"

        def fresh_tmp() -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

        on_rank0(lambda: self._check_room(final), CheckpointError)
        on_rank0(fresh_tmp, CheckpointError)
        own_crcs = self._write_own_files(tmp, final, own_files or {})
        # Before the first update Adam has no state, which Megatron's distributed optimizer cannot save; zero
        # moments and step 0 are what the first update starts from anyway.
        allocate_optimizer_state(actor.optimizer)
        model_sd = model_sharded_state_dict(actor.chunks)
        state = {
            "model": model_sd,
            "optimizer": optimizer_state(actor, model_sd, self.optimizer_format),
            "rng": _rng_object(self.ctx),
            "scheduler": actor.scheduler.state_dict(),
            "run": run_state,
            "format": {
                **format_record("run", spec, actor.chunks, layout_of(self.ctx), step),
                "optimizer_format": self.optimizer_format,
            },
        }
        finish = functools.partial(self._complete, tmp, final, start, own_crcs)
        strategy = self._save_strategy(state)
        if self._async_queue is not None and background:
            request = save_in_background(state, str(tmp), strategy)
            request.add_finalize_fn(finish)
            self._async_queue.schedule_async_request(request)
            self._writing = (tmp, final)
            log.info("checkpoint %s: writing in the background (%.1f s blocked)", final, time.perf_counter() - start)
        else:
            self._replace_dead_manager()  # died since the step boundary: the save would fail on its queue
            try:
                dist_checkpointing.save(state, str(tmp), strategy, validate_access_integrity=False)
                finish()
            except (Exception, CheckpointException) as err:  # a full disk, an I/O error (on any rank)
                self._abandon(tmp, final, err)
        return final

    def _write_own_files(self, tmp: Path, final: Path, files: dict[str, Any]) -> dict[str, int]:
        """Write this rank's own files into the save (collective: a failure on any rank abandons the save on
        every rank); returns their CRC-32s by name."""
        crcs, failure = {}, None
        try:
            for name, obj in files.items():
                path = tmp / name
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(obj, path)
                crcs[name] = file_crc32(path)
        except OSError as err:
            failure = err
        failures = [f for f in all_gather_objects(None if failure is None else f"{failure}") if f is not None]
        if failures:
            self._abandon(tmp, final, failure or OSError(f"another rank: {failures[0]}"))
        return crcs

    def _save_strategy(self, state: dict[str, Any]) -> Any:
        """Megatron's fully parallel save over the data-parallel group: a tensor every DP rank holds (the dense
        weights) is written by one of them chosen per tensor, not all by the first DP rank, so that each rank
        writes and stages about 1 / DP of the weights. Only metadata crosses the ranks.

        Which rank writes what (every shard's metadata gathered over DP, then dealt greedily) is computed at the
        first save and reused while the sharded state keeps its structure (Megatron's do_cache_distribution, which
        checks nothing itself: a stale distribution writes a wrong save). Each rank fingerprints its sharded state
        and the DP ranks agree (one int) on whether any changed, so that all recompute it together."""
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        if self._save_wrapper is None:
            self._save_wrapper = FullyParallelSaveStrategyWrapper(
                get_default_save_sharded_strategy(), self.ctx.pg.dp, do_cache_distribution=True
            )
        structure = sharded_structure(state)
        changed = torch.tensor([int(structure != self._saved_structure)], device=self.ctx.device)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.ctx.pg.dp)
        if changed.item():
            self._save_wrapper.cached_distribution = None
        self._saved_structure = structure
        return self._save_wrapper

    def _load_strategy(self, path: Path) -> Any:
        """Megatron's fully parallel load over the data-parallel group: each weight the DP ranks share is read
        from storage by one of them and broadcast to the others, not read DP times."""
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)), self.ctx.pg.dp)

    def _check_room(self, final: Path) -> None:
        """Refuse to start a save the file system cannot hold, judged by the size of the newest save."""
        previous = find_latest_complete(self.root)
        if previous is None:
            return
        needed, free = dir_bytes(previous), shutil.disk_usage(self.root).free
        if free < needed:
            raise CheckpointError(
                f"not enough space for checkpoint {final}: the last save ({previous.name}) took "
                f"{needed / 2**20:.1f} MiB, {self.root} has {free / 2**20:.1f} MiB free; every earlier save is kept"
            )

    def _abandon(self, tmp: Path, final: Path, err: BaseException) -> None:
        """After a failed save: remove its partial directory (rank 0), keep `latest` and every earlier save, and
        stop with one line saying what failed, what it needed and what was free."""
        previous = find_latest_complete(self.root) if self.ctx.rank == 0 else None
        needed = f"about {dir_bytes(previous) / 2**20:.1f} MiB (the size of {previous.name})" if previous else None
        written = dir_bytes(tmp) / 2**20 if self.ctx.rank == 0 and tmp.exists() else 0.0
        free = shutil.disk_usage(self.root).free / 2**20
        if self.ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {final} failed: {_first_cause(err)}; {written:.1f} MiB were written and "
            f"{free:.1f} MiB were free in {self.root} when it failed"
            + (f", it needed {needed}" if needed else "")
            + "; the partial save was removed, `latest` and every earlier save are kept"
        ) from None

    def poll(self) -> None:
        """Complete a background save whose shards are written (collective; call once per step)."""
        self._finalize_background_save(blocking=False)

    def wait(self) -> None:
        """Block until a background save is complete (collective)."""
        self._finalize_background_save(blocking=True)

    def _finalize_background_save(self, blocking: bool) -> None:
        """A background save that failed (a full disk in the writer process, on any rank: Megatron-Core raises
        it on every rank when finalizing) ends like a failed synchronous one (_abandon). A writer process that
        died (killed, out of memory) is found here first, on every rank alike: see _check_writers."""
        if self._async_queue is None:  # synchronous saves write through the same results queue
            self._replace_dead_manager()
            return
        self._check_writers()
        if self._writing is None:
            return
        try:
            self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        except (Exception, CheckpointException) as err:
            tmp, final = self._writing
            self._writing = None
            self._abandon(tmp, final, err)
        if self._async_queue.get_num_unfinalized_calls() == 0:
            self._writing = None

    def _check_writers(self) -> None:
        """The processes background saves rely on, on every rank (collective): Megatron's per-save writer and
        the manager process behind its write-results queue. A dead manager is replaced (a warning names it);
        a save in flight whose writer or manager died cannot complete: it is dropped and WriterDied names the
        process (the trainer then saves synchronously and stops)."""
        problems = [p for p in all_gather_objects(self._writer_problem()) if p]
        if dead_writer_manager() is not None:
            restart_writer_manager()
        if not problems:
            return
        if self._writing is None:  # only an idle manager died: replaced, nothing lost
            log.warning("checkpoint writer: %s; started a new one", "; ".join(problems))
            return
        tmp, final = self._writing
        self._writing = None
        for call in self._async_queue.async_calls:  # this rank's writer may still be writing: stop it
            process = getattr(call.async_caller, "process", None)
            if process is not None and process.is_alive():
                process.kill()
                process.join()
        self._async_queue.async_calls.clear()
        dist.barrier()
        if self.ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise WriterDied(
            f"the background save {final} was lost: {'; '.join(problems)}; its partial directory was removed, "
            "`latest` and every earlier save are kept"
        )

    def _replace_dead_manager(self) -> None:
        """A dead write-results manager replaced before a synchronous save needs its queue (a kill -9 of it used
        to cost every step since the last save: the save failed with ConnectionRefusedError and a line about
        disk space). This rank's own; each rank replaces its own."""
        if (process := dead_writer_manager()) is not None:
            log.warning("checkpoint writer: rank %d: the write-results manager process (pid %d) %s; started a new one",
                        self.ctx.rank, process.pid, _fate(process))  # fmt: skip
            restart_writer_manager()

    def _writer_problem(self) -> str | None:
        """This rank's dead writer-side process, named; None when every one is alive or ended normally."""
        rank = self.ctx.rank
        if (process := dead_writer_manager()) is not None:
            return f"rank {rank}: the write-results manager process (pid {process.pid}) {_fate(process)}"
        for call in self._async_queue.async_calls if self._async_queue is not None else ():
            process = getattr(call.async_caller, "process", None)
            if process is not None and process.exitcode not in (None, 0):
                return f"rank {rank}: the background writer process (pid {process.pid}) {_fate(process)}"
        return None

    def _complete(self, tmp: Path, final: Path, start: float, own_crcs: dict[str, int]) -> None:
        dist.barrier()  # every rank's shards are on disk
        # each rank checksums the shard files it wrote (torch's writer names them __<rank>_<n>.distcp)
        own = {p.name: file_crc32(p) for p in tmp.glob(f"__{self.ctx.rank}_*.distcp")} | own_crcs
        crcs = {name: crc for part in all_gather_objects(own) for name, crc in part.items()}

        def publish() -> None:  # rank 0; an error (full disk, ...) is raised on every rank
            if self.hf_assets_from:
                copy_hf_assets(Path(self.hf_assets_from), tmp)
            write_manifest(tmp, crcs)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            atomic_write(self.root / LATEST, final.name)
            self._prune(final)
            log.info(
                "saved checkpoint %s in %.1f s (%.1f MiB)", final, time.perf_counter() - start, dir_bytes(final) / 2**20
            )

        on_rank0(publish, CheckpointError)

    def _prune(self, newest: Path) -> None:
        """Delete all but the newest `keep_last` saves up to `newest` (the one just written; saves after it
        were set aside when the run resumed, see set_aside_after)."""
        saves = sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name <= newest.name)
        for old in saves[: max(len(saves) - self.keep_last, 0)]:
            shutil.rmtree(old, ignore_errors=True)

    def set_aside_after(self, step: int) -> None:
        """A run resuming at `step` moves later saves (another line of training, or damaged ones it skipped)
        to <dir>/set_aside/, where pruning never looks: kept for the user, out of resume=auto's way."""

        def move() -> None:
            for later in sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name > step_dir_name(step)):
                target = self.root / "set_aside" / f"{later.name}-{time.strftime('%Y%m%d-%H%M%S')}"
                target.parent.mkdir(exist_ok=True)
                later.rename(target)
                log.warning("resuming at step %d: moved the later save %s to %s", step, later.name, target)
            remaining = sorted(p.name for p in self.root.glob("step_*") if p.is_dir())
            if (self.root / LATEST).is_file():
                if remaining:
                    atomic_write(self.root / LATEST, remaining[-1])
                else:
                    (self.root / LATEST).unlink()

        on_rank0(move, CheckpointError)

    def remove_partials(self) -> None:
        """Delete the partial directories of saves that never finished (a killed job, a full disk): they hold
        nothing a resume can use, and on a full disk they keep the next save from fitting."""

        def remove() -> None:
            for partial in sorted(self.root.glob(".step_*.tmp")):
                size = dir_bytes(partial)
                shutil.rmtree(partial, ignore_errors=True)
                log.warning("removed %s, a save that never finished (%.1f MiB)", partial, size / 2**20)

        on_rank0(remove, CheckpointError)

    # ----- finding ----------------------------------------------------------------------------------------
    def latest_complete(self) -> Path | None:
        """The newest intact save (sizes and checksums), the same on every rank; skipped ones are logged.
        Collective: each rank reads its share of each candidate's files (checksum_share)."""
        candidates = broadcast_object([str(p) for p in saves_newest_first(self.root)], src=0)
        for ckpt in map(Path, candidates):
            problem = self._problem_found_by_any_rank(ckpt)
            if problem is None:
                return ckpt
            if self.ctx.rank == 0:
                log.warning("skipping %s: %s", ckpt.name, problem)
        return None

    def verified(self, path: Path) -> Path:
        """`path`, after checking every file's size and checksum (a CheckpointError names the damaged file, on
        every rank). Collective: each rank reads its share of the files (checksum_share)."""
        problem = self._problem_found_by_any_rank(path)
        if problem is not None:
            raise CheckpointError(problem)
        return path

    def _problem_found_by_any_rank(self, ckpt: Path) -> str | None:
        """What is wrong with `ckpt` (the lowest rank's finding) or None; each rank checks the sizes and the
        CRC-32 of its share of the files, so no rank reads the whole save while the others wait."""
        try:
            verify_complete(ckpt, checksums=True, share=(self.ctx.rank, self.ctx.world_size))
            found = None
        except CheckpointError as err:
            found = str(err)
        except OSError as err:  # an unreadable file: reported on every rank like damage
            found = f"checkpoint {ckpt} could not be read: {type(err).__name__}: {err}"
        return next((p for p in all_gather_objects(found) if p is not None), None)

    # ----- loading ----------------------------------------------------------------------------------------
    def load(self, path: Path, actor: Any, spec: ModelSpec) -> dict[str, Any]:
        """Load model, optimizer, LR schedule (and RNG at the same layout); return the saved run state."""
        from megatron.core import dist_checkpointing

        common = _run_common_state(path)
        check_model_spec(common["format"]["model_spec"], spec, path)
        saved_format = common["format"].get("optimizer_format", BEFORE_FORMATS)
        refuse_other_layout(path, common["format"]["layout"], layout_of(self.ctx), saved_format)
        model_sd = model_sharded_state_dict(actor.chunks)
        allocate_optimizer_state(actor.optimizer)
        state = {"model": model_sd, "optimizer": optimizer_state(actor, model_sd, saved_format, is_loading=True)}
        same_layout = common["format"]["layout"] == layout_of(self.ctx)
        if same_layout:
            state["rng"] = _rng_object(self.ctx)
        try:
            loaded = dist_checkpointing.load(state, str(path), self._load_strategy(path))
        except Exception as err:  # a file the manifest vouched for, yet unreadable
            raise CheckpointError(f"checkpoint {path} could not be read: {type(err).__name__}: {err}") from err
        for i, chunk in enumerate(actor.chunks):
            unwrap(chunk).load_state_dict(loaded["model"][f"chunk{i}"], strict=True)
        # no_grad: Megatron-Core 0.16.1 copies dp_reshardable state into the leaf master params with autograd on
        with adam_step_fixed(actor.optimizer), torch.no_grad():
            actor.optimizer.load_state_dict(loaded["optimizer"])
        sync_offloaded_optimizer_after_load(actor.optimizer)  # optimizer.cpu_offload: the CPU Adam's own copies
        # Megatron's load_state_dict *adds* the saved step count to the current one (ours starts at 1)
        actor.scheduler.num_steps = 0
        actor.scheduler.load_state_dict(common["scheduler"])
        if same_layout:
            _restore_rng(loaded["rng"])
        else:
            log.warning(
                "checkpoint %s was saved at layout %s, this run is %s: model, optimizer and schedule reshard; "
                "per-rank RNG states start fresh",
                path,
                common["format"]["layout"],
                layout_of(self.ctx),
            )
        return {**common["run"], "step": common["format"]["step"]}


def read_resume_state(path: Path, spec: ModelSpec, layout: dict[str, int] | None) -> dict[str, Any]:
    """The run state of the save `path` (its step, data position, sampler state, logger run id) for a run at
    `layout` (None: not checked) to resume, after every check a resume makes before it reads a weight: a run
    checkpoint of the model `spec` describes, whose optimizer state reloads at `layout` (refuse_other_layout), and
    that holds in its manifest every file of its own its records list (partial rollout's unfinished groups, a file
    per engine replica; the manifest check vouches for their sizes and checksums). The same function in `train`
    (on every rank, their outcome agreed: build.find_resume) and in `check` (for the job's layout)."""
    common = _run_common_state(path)
    saved = common["format"]
    check_model_spec(saved["model_spec"], spec, path)
    if layout is not None:
        refuse_other_layout(path, saved["layout"], layout, saved.get("optimizer_format", BEFORE_FORMATS))
    state = {**common["run"], "step": saved["step"]}
    pending = state.get("sampler", {}).get("pending")
    if pending is not None:
        check_listed_files(path, listed_files(pending))
    return state


def check_listed_files(path: Path, listed: dict[str, str]) -> None:
    """Each file the save's records say it holds (name -> what it holds) is one of the save's files (in its
    manifest): a file missing with its manifest entry (deleted by hand, a copy that left it out) was found only by
    the rank that reads it, halfway through loading, while the others went on into the next collective."""
    files = read_manifest(path)
    for name, what in listed.items():
        if name not in files:
            there = (
                "on disk, but not in its manifest" if (path / name).is_file() else "not on disk, not in its manifest"
            )
            raise CheckpointError(
                f"checkpoint {path}: its run state lists {what} in {name}, a file the save does not hold ({there}); "
                "restore it from a copy of the save, or resume an earlier save (checkpoint.resume=PATH)"
            )


def verify_all_but_shards(ckpt: Path) -> None:
    """What `check` verifies of a save (on a login node it does not checksum terabytes): every file's size, and
    the CRC-32 of every file but the weight and optimizer shards (*.distcp): its common state, metadata, files of
    its own (partial rollout's) and HF assets, the files a damaged copy of which train refuses or skips too."""
    verify_complete(ckpt)
    for name, entry in read_manifest(ckpt).items():
        if not name.endswith(".distcp") and entry["crc32"] is not None and file_crc32(ckpt / name) != entry["crc32"]:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {name} fails its CRC-32 check")


def read_own_file(path: Path, name: str) -> Any:
    """A file one rank wrote into the save `path` (CheckpointManager.save's own_files), read without unpickling
    classes and with its tensors mapped from the file (a rank takes only what it needs of them)."""
    try:
        return torch.load(path / name, weights_only=True, mmap=True)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as err:
        raise CheckpointError(f"checkpoint {path}: {name} could not be read: {type(err).__name__}: {err}") from None


def _run_common_state(path: Path) -> dict[str, Any]:
    common = read_common(path)
    if common["format"].get("kind") != "run":
        raise CheckpointError(
            f"{path} is not a run checkpoint (a converted model? start from it with "
            "model.init=mcore model.mcore_path=...)"
        )
    return common


def _restore_rng(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _first_cause(err: BaseException) -> str:
    """The underlying error of a failed save in one line (torch's CheckpointException wraps each rank's)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_first_cause(inner)}"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def saves_newest_first(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)


def find_latest_complete(
    root: Path, checksums: bool = False, verify: Callable[[Path], Any] | None = None
) -> Path | None:
    """The newest save that checks out (`verify`, else verify_complete with or without checksums); every newer one
    skipped is logged with why. (`latest` names the same save unless a job was killed between a save's rename and
    the pointer's update: then this one is newer.) One process; CheckpointManager.latest_complete spreads the
    reading over ranks."""
    for ckpt in saves_newest_first(root):
        try:
            if verify is not None:
                verify(ckpt)
            else:
                verify_complete(ckpt, checksums=checksums)
            return ckpt
        except CheckpointError as err:
            log.warning("skipping %s: %s", ckpt.name, err)
    return None
