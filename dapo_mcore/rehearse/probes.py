"""What a rehearsal measures on each rank, phase by phase (docs/rehearsal.md).

A `RankProbe` is a phase observer (utils/timers.py): around every phase of the real loop (the step, and in it
generate, reward, exchange, old_logprobs, update, weight_push; save; restore) it records, for this rank:

- seconds (wall time, less what the probe itself spent inside);
- peak resident set size: the kernel's high-water mark (VmHWM), reset at each phase's start through
  /proc/self/clear_refs, so a phase's peak is its own (a nested phase's peak counts in its parent's);
- the device's peak allocation where CUDA is in use (torch.cuda.max_memory_allocated, reset likewise);
- bytes sent and received through torch.distributed (`ByteCounter`: the buffers each collective reads and
  writes on this rank, see `_payload`), which is what a per-rank array gathered from every rank shows up in;
- at its end, a census of the live Python objects: how many the garbage collector tracks, the bytes of every
  live tensor (storages counted once; Megatron's attention workspace apart), the largest tensors and the
  longest containers, each named by the attribute or key that holds it where one does.

Records go to one JSON line per phase instance in the rank's file; rehearse/report.py reads them.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_MB = 2**20


def peak_rss_kb() -> int:
    """The process's resident-set high-water mark since start or the last reset (kB)."""
    return _status_kb("VmHWM")


def rss_kb() -> int:
    return _status_kb("VmRSS")


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def reset_peak_rss() -> None:
    """Make VmHWM the current RSS (Linux: writing 5 to clear_refs resets the peak RSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:  # not Linux, or not allowed: peaks then run from the process's start
        pass


# ---- bytes through torch.distributed -------------------------------------------------------------------------
def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _group_rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _payload(name: str, a: dict[str, Any]) -> tuple[int, int]:
    """(bytes sent, bytes received) by this rank in one collective, from its arguments by name: the bytes of the
    buffers it hands over and of those that land on it, its own part included. So a collective over a fixed
    tensor (an all-reduce of metrics, the distributed optimizer's gather of the full parameters) stays flat as
    ranks are added, and a gather of every rank's share grows with them. Not the wire's bytes: a ring
    all-reduce moves about twice its tensor."""
    if _group_rank_size(a.get("group"))[1] <= 1:
        return 0, 0
    if name == "all_reduce":
        return _nbytes(a["tensor"]), _nbytes(a["tensor"])
    if name == "broadcast":  # src is a global rank; group_src (newer torch) a rank in the group
        is_src = a.get("src") == dist.get_rank() or a.get("group_src") == _group_rank_size(a.get("group"))[0]
        return (_nbytes(a["tensor"]), 0) if is_src else (0, _nbytes(a["tensor"]))
    if name == "all_gather":
        return _nbytes(a["tensor"]), sum(_nbytes(t) for t in a["tensor_list"])
    if name == "all_gather_into_tensor":
        return _nbytes(a["input_tensor"]), _nbytes(a["output_tensor"])
    if name == "reduce_scatter_tensor":
        return _nbytes(a["input"]), _nbytes(a["output"])
    if name == "all_to_all_single":
        return _nbytes(a["input"]), _nbytes(a["output"])
    if name == "all_to_all":
        return sum(map(_nbytes, a["input_tensor_list"])), sum(map(_nbytes, a["output_tensor_list"]))
    if name in ("send", "isend"):
        return _nbytes(a["tensor"]), 0
    if name in ("recv", "irecv"):
        return 0, _nbytes(a["tensor"])
    return 0, 0


_COUNTED = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "send",
    "isend",
    "recv",
    "irecv",
)


class _Inside(threading.local):
    active = False


@dataclass
class ByteCounter:
    """Counts the payload of every torch.distributed collective of this process. Installed before Megatron-Core
    is imported (it keeps references to some collectives from its import on); the object collectives
    (all_gather_object, broadcast_object_list, ...) are counted through the tensor collectives they call."""

    sent: int = 0
    received: int = 0
    by_call: dict[str, list[int]] = field(default_factory=dict)
    _originals: dict[str, Any] = field(default_factory=dict)
    _inside: threading.local = field(default_factory=_Inside)

    def install(self) -> ByteCounter:
        from torch.distributed import distributed_c10d

        for name in _COUNTED:
            original = getattr(distributed_c10d, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            wrapped = self._wrap(name, original)
            setattr(distributed_c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
        return self

    def uninstall(self) -> None:
        from torch.distributed import distributed_c10d

        for name, original in self._originals.items():
            setattr(distributed_c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            # A collective called again from inside one is the same transfer: the CPU device mode's
            # __torch_function__ (parallel/cpu_mode.py) calls the public name, this wrapper, a second time.
            if self._inside.active:
                return original(*args, **kwargs)
            sent, received = _payload(name, signature.bind(*args, **kwargs).arguments)
            self.sent += sent
            self.received += received
            calls = self.by_call.setdefault(name, [0, 0, 0])
            calls[0], calls[1], calls[2] = calls[0] + 1, calls[1] + sent, calls[2] + received
            self._inside.active = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.active = False

        counted.__wrapped__ = original
        counted.__name__ = name
        return counted


# ---- the live objects ----------------------------------------------------------------------------------------
TOP = 3  # the largest tensors and longest containers a census names


def census(names: dict[tuple[int, int], str] | None = None) -> dict[str, Any]:
    """The live objects the garbage collector tracks: their count, the bytes of all live tensors (each storage
    once), the TOP largest tensors and longest lists / tuples / dicts / sets, named by what holds them (`names`
    caches the names already found, by object id and size: finding one scans every object)."""
    objects = gc.get_objects()  # no gc.collect() first: 0.3 s a phase, for cycles not yet collected
    workspace = _workspace_storages()
    storages: dict[int, tuple[int, Any]] = {}  # storage -> (bytes, its tensor of the most elements)
    containers: list[tuple[int, int, Any]] = []  # (len, id, container): the TOP longest
    for obj in objects:
        kind = type(obj)
        if kind in _CONTAINERS:
            _keep_top(containers, len(obj), obj)
        elif _is_tensor_type(kind) and not obj.is_meta and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            address = _address(storage)
            if address is None or address in workspace:
                continue
            known = storages.get(address)
            if known is None or obj.numel() > known[1].numel():  # a view names its storage less well
                storages[address] = (storage.nbytes(), obj)
    count = len(objects)
    del objects
    tensors: list[tuple[int, int, Any]] = []  # (bytes, id, tensor): the TOP largest storages
    for size, tensor in storages.values():
        _keep_top(tensors, size, tensor)
    names = {} if names is None else names
    # the census's own references are no holders
    ignore = {id(tensors), id(containers), *(id(entry) for entry in tensors + containers)}
    ignore |= {id(storages), *(id(entry) for entry in storages.values())}
    return {
        "objects": count,
        "tensor_bytes": sum(size for size, _ in storages.values()),
        "workspace_bytes": sum(workspace.values()),
        "largest_tensors": [
            {
                "bytes": size,
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "held_by": _name(names, t, size, ignore),
            }
            for size, _, t in tensors
        ],
        "longest_containers": [
            {"len": size, "type": type(c).__name__, "held_by": _name(names, c, size, ignore)}
            for size, _, c in containers
        ],
    }


def _keep_top(top: list[tuple[int, int, Any]], size: int, obj: Any) -> None:
    if len(top) < TOP or size > top[-1][0]:
        top.append((size, id(obj), obj))
        top.sort(key=lambda entry: -entry[0])
        del top[TOP:]


def _workspace_storages() -> dict[int, int]:
    """Megatron's global memory buffer (its local attention's score workspace, sized by the micro-batch being
    computed; Transformer Engine's fused attention on a GPU keeps none): storage -> bytes. Counted apart from
    the live tensors, which it would otherwise swamp with the shapes the rehearsal happened to compute."""
    state = sys.modules.get("megatron.core.parallel_state")
    buffer = getattr(getattr(state, "_GLOBAL_MEMORY_BUFFER", None), "buffer", None) or {}
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffer.values()}


_CONTAINERS = (list, tuple, dict, set)
_TENSOR_TYPES: dict[type, bool] = {}


def _address(storage) -> int | None:
    """Where a storage's memory is; None where torch refuses to say (a traced tensor that holds none)."""
    try:
        return storage.data_ptr()
    except RuntimeError:
        return None


def _is_tensor_type(kind: type) -> bool:
    """issubclass on the type, cached: isinstance would call __instancecheck__ of every object's class (some of
    the imported packages' proxies warn when asked)."""
    known = _TENSOR_TYPES.get(kind)
    if known is None:
        known = _TENSOR_TYPES[kind] = issubclass(kind, torch.Tensor) and not issubclass(kind, _memoryless_types())
    return known


def _memoryless_types() -> tuple[type, ...]:
    """The tensors torch.compile / export trace with (in a test process, left alive by another test's compiled
    function): they stand for memory they do not hold."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return FakeTensor, FunctionalTensor


def _name(names: dict[tuple[int, int], str], obj: Any, size: int, ignore: set[int]) -> str:
    key = (id(obj), size)
    if key not in names:
        names[key] = held_by(obj, ignore=ignore)
    return names[key]


def held_by(obj: Any, depth: int = 3, ignore: set[int] | None = None) -> str:
    """A name for what holds `obj`: Class.attribute, Class.attribute['key'], Class.attribute[i], ... ('?' where
    the holder is a frame, a closure or nothing nameable within `depth` steps). An object's attribute is
    preferred to a dict's key, a key to a list's place; referrers in `ignore` (by id) are passed over."""
    if depth == 0:
        return "?"
    referrers = gc.get_referrers(obj)
    ignore = {*(ignore or ()), id(referrers)}  # the list just made refers to everything it lists
    keyed, placed = None, None
    for ref in referrers:
        if id(ref) in ignore or isinstance(ref, type):
            continue
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is obj), _MISSING)
            if key is _MISSING:
                continue
            owner = next((o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), None)
            if owner is not None:
                return f"{type(owner).__name__}.{key}"
            keyed = keyed or (ref, key)
        elif isinstance(ref, (list, tuple)):
            if not _is_gc_listing(ref):
                placed = placed or ref
        elif hasattr(ref, "__dict__"):  # Python 3.11+ keeps attributes inline (no __dict__ until asked for)
            attribute = next((k for k, v in vars(ref).items() if v is obj), None)
            if attribute is not None:
                return f"{type(ref).__name__}.{attribute}"
    del referrers
    if keyed is not None:
        key = keyed[1] if isinstance(keyed[1], (str, int, tuple)) else f"<{type(keyed[1]).__name__}>"
        return f"{held_by(keyed[0], depth - 1, ignore)}[{key!r}]"
    if placed is not None:
        index = next((i for i, v in enumerate(placed) if v is obj), None)
        return f"{held_by(placed, depth - 1, ignore)}[{index}]"
    return "?"


_MISSING = object()


def _is_gc_listing(ref: list | tuple) -> bool:
    """The list gc.get_objects() returned to a caller up the stack (not a holder of the object)."""
    return isinstance(ref, list) and len(ref) > 100_000 and any(isinstance(x, type) for x in ref[:100])


# ---- the probe ------------------------------------------------------------------------------------------------
@dataclass
class _Open:
    name: str
    start: float
    sent: int
    received: int
    probe_seconds: float
    peak_kb: int
    device_peak: int = 0


class RankProbe:
    """The phase observer of one rank: one JSON line per phase instance into `path`."""

    def __init__(self, path: Path, counter: ByteCounter, census_phases: bool = True):
        self.path, self.counter, self.census_phases = path, counter, census_phases
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.host = socket.gethostname()
        self._open: list[_Open] = []
        self._probe_seconds = 0.0  # spent in census and bookkeeping: not the phases' time
        self._seen: dict[str, int] = {}
        self.steps = 0
        self.process_peak_kb = 0  # the whole process's, across the resets
        self._names: dict[tuple[int, int], str] = {}  # what holds the largest objects, found once

    def enter(self, name: str) -> None:
        began = time.perf_counter()
        peak = peak_rss_kb()
        self.process_peak_kb = max(self.process_peak_kb, peak)
        if self._open:  # the parent's peak so far, before the reset hides it
            self._open[-1].peak_kb = max(self._open[-1].peak_kb, peak)
            self._open[-1].device_peak = max(self._open[-1].device_peak, _device_peak())
        reset_peak_rss()
        _reset_device_peak()
        if name == "step":
            self.steps += 1
        # a marker: a rank that dies inside the phase leaves it as its last line
        self._write({"event": "enter", "rank": self.rank, "phase": name, "step": self.steps})
        self._probe_seconds += time.perf_counter() - began
        c = self.counter
        self._open.append(_Open(name, time.perf_counter(), c.sent, c.received, self._probe_seconds, peak_rss_kb()))

    def exit(self, name: str) -> None:
        ended = time.perf_counter()
        frame = self._open.pop()
        peak_kb, device_peak = max(frame.peak_kb, peak_rss_kb()), max(frame.device_peak, _device_peak())
        if self._open:
            self._open[-1].peak_kb = max(self._open[-1].peak_kb, peak_kb)
            self._open[-1].device_peak = max(self._open[-1].device_peak, device_peak)
        index = self._seen[name] = self._seen.get(name, 0) + 1
        self.process_peak_kb = max(self.process_peak_kb, peak_kb)
        record = {
            "event": "exit",
            "rank": self.rank,
            "world": self.world,
            "host": self.host,
            "phase": name,
            "index": index,
            "step": self.steps,
            "seconds": ended - frame.start - (self._probe_seconds - frame.probe_seconds),
            "peak_rss_mb": peak_kb / 1024,
            "rss_mb": rss_kb() / 1024,
            "device_peak_mb": device_peak / _MB,
            "sent_bytes": self.counter.sent - frame.sent,
            "received_bytes": self.counter.received - frame.received,
        }
        if self.census_phases:
            record.update(census(self._names))
        self._write(record)
        self._probe_seconds += time.perf_counter() - ended

    def finish(self) -> None:
        """The whole process: its peak RSS across every phase and the start-up, its bytes by collective."""
        self.process_peak_kb = max(self.process_peak_kb, peak_rss_kb())
        c = self.counter
        self._write({"event": "process", "rank": self.rank, "world": self.world, "host": self.host,
                     "peak_rss_mb": self.process_peak_kb / 1024, "sent_bytes": c.sent,
                     "received_bytes": c.received, "by_call": c.by_call})  # fmt: skip

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")


def _device_peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def _reset_device_peak() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
