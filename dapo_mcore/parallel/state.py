"""Process groups of a run: the only module that calls megatron.core.parallel_state.

Everything else receives a ParallelContext and passes its groups explicitly (DESIGN.md rule 4).
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dapo_mcore.parallel.cpu_mode as cpu_mode
from dapo_mcore.parallel.gloo_net import choose_gloo_interface
from dapo_mcore.parallel.liveness import PeerWatch, gone_peer_line
from dapo_mcore.utils.errors import LayoutError
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class ParallelContext:
    device: torch.device
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    # Virtual pipeline stages (model chunks) per rank; 1 without interleaving.
    vpp_size: int
    # Data parallelism without CP: the ranks that hold the same model shard and train other samples; the CP
    # ranks of one sequence share dp_rank (they receive the same samples and split each sequence).
    dp_rank: int
    dp_size: int
    # Megatron's ProcessGroupCollection (tp, pp, dp, dp_cp, cp, embd, pos_embd, mp, ep, expt_tp, expt_dp, ...):
    # pg.cp joins the CP ranks of one sequence, pg.dp_cp the DP x CP ranks that sum gradients and token counts.
    pg: Any
    # Global rank of each pipeline stage of this rank's pipeline, first to last.
    pp_global_ranks: list[int]
    # Every rank, on gloo, with a timeout of its own (parallel.generation_timeout_minutes): where replicas meet
    # after generating, a fast replica waits for the slowest one's long answers longer than any collective of
    # the default group may wait. Only small objects cross it.
    wait_group: Any = None
    # Expert parallelism (mixture-of-experts models): the experts are split over ep_size ranks, each expert's
    # MLP over etp_size ranks (expert TP); 1 and 1 for dense models.
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    # Context parallelism: each sequence split over cp_size ranks (docs/design/context_parallel.md); 1 without.
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def chunk_has_embedding(self, chunk: int) -> bool:
        """Model chunk `chunk` of this rank is the first virtual stage of the whole pipeline."""
        return self.is_first_stage and chunk == 0

    def chunk_has_head(self, chunk: int) -> bool:
        """Model chunk `chunk` of this rank is the last virtual stage of the whole pipeline."""
        return self.is_last_stage and chunk == self.vpp_size - 1

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def describe(self) -> str:
        experts = ""
        if self.ep_size > 1 or self.etp_size != self.tp_size:
            experts = f"; experts: EP {self.ep_size} x expert TP {self.etp_size}"
        cp = f" x CP {self.cp_size}" if self.cp_size > 1 else ""
        return (
            f"world={self.world_size} = TP {self.tp_size}{cp} x PP {self.pp_size} x DP {self.dp_size}{experts} "
            f"on {self.device.type} ({'gloo' if self.is_cpu else 'nccl'})"
        )


def check_layout(world_size: int, tp: int, pp: int, vpp: int = 1, ep: int = 1, etp: int = 0, cp: int = 1) -> int:
    """The data-parallel size of a layout (without CP: world / (TP x PP x CP), as Megatron-Core's
    initialize_model_parallel computes it), or a LayoutError that says what does not divide. The experts
    (ep > 1 or an expert TP etp; 0: the same as tp) take the same ranks in another split, EP x expert TP x PP
    x expert DP, which must divide the world as well (Megatron-Core's MoE parallel folding); they ignore CP (its
    expert rank generator has no CP axis: expert DP spans the CP ranks), so that condition does not change."""
    if vpp > 1 and pp < 2:
        raise LayoutError(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size >= 2"
        )
    etp = etp or tp
    for name, size in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
        ("context_parallel_size", cp),
    ):
        if size < 1:
            raise LayoutError(f"parallel.{name} must be >= 1, got {size}")
    model_ranks = tp * pp * cp
    if world_size % model_ranks:
        with_cp = f" x CP={cp}" if cp > 1 else ""
        raise LayoutError(
            f"parallel layout TP={tp} x PP={pp}{with_cp} = {model_ranks} ranks does not divide the world size "
            f"{world_size}; launch a multiple of {model_ranks} processes or change "
            f"parallel.tensor_model_parallel_size / parallel.pipeline_model_parallel_size"
            + (" / parallel.context_parallel_size" if cp > 1 else "")
        )
    if world_size % (ep * etp * pp):
        raise LayoutError(
            f"expert layout EP={ep} x expert TP={etp} x PP={pp} = {ep * etp * pp} ranks does not divide the world "
            f"size {world_size}; change parallel.expert_model_parallel_size / parallel.expert_tensor_parallel_size"
        )
    return world_size // model_ranks


def resolve_device(preference: str) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise LayoutError("parallel.device=cuda but no CUDA device is visible")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


# Warnings Megatron-Core 0.16 to 0.19 raises on every run that say nothing about the run itself.
_BENIGN_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
    (UserWarning, r"full scope is deprecated"),
    # its checkpoint loader calls torch's deprecated name, on every resume
    (FutureWarning, r"`load_state_dict` is deprecated"),
    # Megatron-Core 0.19 imports these modules on every run (0.16.1 did not): absl-py is not its dependency, and
    # the multimodal model's config is not one the project uses (mcore/mcore_compat.py lists them)
    (UserWarning, r"absl\.logging is not installed"),
    (UserWarning, r"MimoModelConfig is experimental"),
)
# ... and those that are expected in the CPU mode (no Apex / Transformer Engine there by design).
_CPU_MODE_WARNINGS = (
    (UserWarning, r"(Transformer Engine and Apex|Apex) (are|is) not installed"),
    # Megatron reads `.grad` of non-leaf tensors; through the CPU device mode that read raises this warning.
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
)


def _quiet_benign_warnings(on_cpu: bool) -> None:
    for category, message in _BENIGN_WARNINGS + (_CPU_MODE_WARNINGS if on_cpu else ()):
        warnings.filterwarnings("ignore", message=message, category=category)


def init_parallel(
    tp: int,
    pp: int,
    device_preference: str = "auto",
    timeout_minutes: float = 30,
    seed: int = 0,
    vpp: int = 1,
    wait_timeout_minutes: float = 240,
    ep: int = 1,
    etp: int = 0,
    peer_timeout_s: float = 120.0,
    cp: int = 1,
) -> ParallelContext:
    """Start torch.distributed (torchrun's env, or a one-process group), Megatron's model parallel groups and
    the wait group (ParallelContext.wait_group). ep / etp: expert parallel and expert tensor parallel sizes
    (etp 0: the same as tp). cp: context parallel size; Megatron's order tp-cp-ep-dp-pp makes a rank's CP peers
    TP ranks apart (world 4, TP 2, CP 2: CP groups [0, 2] and [1, 3]). peer_timeout_s: with more than one rank,
    a rank not heard from for this long (its host died) stops every rank with exit code 76
    (parallel/liveness.py); 0: no watch."""
    device = resolve_device(device_preference)
    _quiet_benign_warnings(device.type == "cpu")
    _ensure_process_group(device, timeout_minutes)
    _watch_peers(peer_timeout_s)
    dp = check_layout(dist.get_world_size(), tp, pp, vpp, ep, etp, cp)
    if device.type == "cpu":
        cpu_mode.activate()
    else:
        torch.cuda.set_device(device)

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp,
        context_parallel_size=cp,
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    ctx = ParallelContext(
        device=device,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        vpp_size=vpp,
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=dp,
        pg=ProcessGroupCollection.use_mpu_process_groups(),
        pp_global_ranks=list(dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group())),
        wait_group=dist.new_group(backend="gloo", timeout=timedelta(minutes=wait_timeout_minutes)),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        ep_size=ep,
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        etp_size=etp or tp,
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=cp,
    )
    log.info("parallel layout: %s", ctx.describe())
    return ctx


def destroy_parallel(keep_world: bool = False) -> None:
    """Tear down Megatron's groups and the process group, after marking this rank as left to the peer watch;
    keep_world=True keeps the process group (and the store it was made with, and the watch), so that the same
    processes can init_parallel again at another layout."""
    from megatron.core import parallel_state as mpu

    if not keep_world:
        _leave_peer_watch()  # first: from here on this rank's silence is a clean end, not a lost host
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if keep_world:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    # A one-process world set RANK, MASTER_PORT, ... here: take them back, or every process started later from
    # this one (a conversion in-process, then a training run) would inherit a world and a port not its own.
    for key, value in list(_ENV_SET_HERE.items()):
        if os.environ.get(key) == value:
            del os.environ[key]
        del _ENV_SET_HERE[key]


_ENV_SET_HERE: dict[str, str] = {}
_PEER_WATCH: list[PeerWatch] = []  # this process's watch while its world lasts (kept by keep_world=True)


def _watch_peers(timeout_s: float) -> None:
    if _PEER_WATCH or timeout_s <= 0 or dist.get_world_size() == 1:
        return
    watch = PeerWatch.start_for_world(dist.get_rank(), dist.get_world_size(), timeout_s)
    if watch is not None:
        _PEER_WATCH.append(watch)


_LAST_PEER_WATCH: list[PeerWatch] = []  # kept after the world is torn down: the failure path asks it afterwards


def gone_peer() -> str | None:
    """The line naming a rank of this host whose process is gone, for the first survivor that asks
    (liveness.gone_peer_line); None without a watch or such a rank. Asked after the run's failure has torn
    the world down, through the watch that world had."""
    watch = (_PEER_WATCH or _LAST_PEER_WATCH or [None])[-1]
    return gone_peer_line(watch) if watch is not None else None


def _leave_peer_watch() -> None:
    """Before the group goes: this rank has left (others must not take its silence for a lost host)."""
    while _PEER_WATCH:
        watch = _PEER_WATCH.pop()
        watch.leave()
        _LAST_PEER_WATCH[:] = [watch]


def _ensure_process_group(device: torch.device, timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    one_process = "RANK" not in os.environ  # a plain `python`/`dapo-mcore` run: a one-process world
    if one_process:
        _set_here(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    choose_gloo_interface()  # gloo carries the wait group on every device
    backend = "gloo" if device.type == "cpu" else "nccl"
    for attempt in range(3):
        try:
            dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
            return
        except dist.DistNetworkError as err:
            # the free port found may be taken before the store listens on it (two runs starting on one host):
            # a one-process world takes another; a launcher's port is the launcher's to choose
            if not one_process or "EADDRINUSE" not in str(err) or attempt == 2:
                raise
            _set_here(MASTER_PORT=str(_free_port()))


def _set_here(**variables: str) -> None:
    os.environ.update(variables)
    _ENV_SET_HERE.update(variables)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_to_all_on_host(
    send_W: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: Any = None
) -> torch.Tensor:
    """A 1-D host tensor cut into one piece per rank (send_sizes), each sent to its rank; returns what every
    rank sent this one, concatenated in rank order (recv_sizes, which the caller knows). Host memory only:
    `group` must be a gloo group (the wait group), so nothing lands on a GPU an engine holds."""
    received_W = torch.empty(sum(recv_sizes), dtype=send_W.dtype)
    dist.all_to_all_single(received_W, send_W.cpu(), recv_sizes, send_sizes, group=group)
    return received_W


def all_reduce_sums_and_maxes(sums: torch.Tensor, maxes: torch.Tensor, group: Any = None) -> None:
    """In place, over the group (every rank by default): `sums` summed, `maxes` maximised. Both on the
    process group's device (NCCL: CUDA tensors)."""
    dist.all_reduce(sums, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """`src` is a global rank. Returns the source's object on every rank of the group."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def on_rank0(fn: Callable[[], Any], error: type[Exception]) -> Any:
    """Run `fn` on global rank 0 only and share its result; if it raises, raise `error` with its message on
    every rank. Other ranks would otherwise wait in the next collective until the timeout (file-system work
    done by rank 0: a full disk, a missing file)."""
    outcome: tuple[bool, Any] = (True, None)
    if dist.get_rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as err:  # shared, then re-raised on every rank below
            outcome = (False, f"{type(err).__name__}: {err}" if not isinstance(err, error) else str(err))
    ok, value = broadcast_object(outcome, src=0)
    if not ok:
        raise error(value)
    return value


class StoreBoard:
    """Small values shared between ranks without a collective, over the process group's key-value store (the
    c10d TCPStore torchrun's rendezvous or init_process_group made): a rank publishes, others read when they
    get there (a read waits for the key, up to `timeout`), counters add up across ranks. For decisions that
    must be the same on a few ranks (an engine replica's TP ranks) or summed over many (kept groups across
    replicas) inside a loop the ranks run at their own pace, where a collective would make every rank wait for
    the slowest, or hang when one leaves the loop."""

    def __init__(self, prefix: str, timeout_minutes: float):
        store = dist.distributed_c10d._get_default_store()  # no public getter; PrefixStore keeps ours apart
        self._store = dist.PrefixStore(prefix, store)
        self._store.set_timeout(timedelta(minutes=timeout_minutes))

    def publish(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def read(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def delete(self, key: str) -> None:
        self._store.delete_key(key)
