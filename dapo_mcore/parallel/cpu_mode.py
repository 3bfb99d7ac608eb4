"""CPU mode: lets Megatron-Core's real code paths (models, schedules, DDP, optimizer, dist_checkpointing) run
on the CPU with gloo, so tests exercise the same code that runs on GPUs.

Megatron-Core 0.16 calls a handful of CUDA-only functions on those paths; each is redirected here, and only
here, and only when `activate()` is called (never on a GPU run):
  1. torch.cuda.current_device()          -> the CPU device (global memory buffer, p2p shape buffers)
  2. the CUDA RNG tracker                 -> a tracker of named CPU generator states (its fork() swaps the
                                             CPU RNG state, so per-TP-rank streams still differ)
  3. factory calls with device="cuda"     -> the CPU (a TorchFunctionMode rewriting the `device` keyword,
                                             e.g. `total_num_tokens` in pipeline_parallel/schedules.py); the
                                             mode is re-entered around custom autograd Functions' backward,
                                             which autograd runs outside it (activation recompute rebuilds
                                             the causal mask with device="cuda" there)
  4. Tensor.cuda(), torch.cuda.synchronize() -> identity / no-op
  5. Tensor.type() strings                -> CPU tensors report 'torch.cuda.*' names, which the optimizer
                                             wrappers and clip_grads.py compare against
  6. the "CUDA" RNG state that activation recompute saves and replays (tensor_parallel.random) -> the
     CPU generator's state
  7. torch.cuda.Stream / stream() / current_stream() -> one host "stream" whose waits and events are no-ops
     (the MoE all-to-all dispatcher copies its split sizes to the host on a side stream)
  8. that dispatcher's device-to-host copy of the split sizes -> numpy arrays from the CPU tensors (it only
     converts CUDA tensors, and torch's all_to_all takes the split sizes as a list, not a tensor)
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE: _CudaToCpuDeviceMode | None = None


class _CudaToCpuDeviceMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _names_cuda(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index means a CUDA device
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def is_active() -> bool:
    return _ACTIVE is not None


def activate() -> None:
    """Install the redirections for this process (idempotent). Refuses to run where CUDA is available."""
    global _ACTIVE
    if _ACTIVE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "CPU mode must not be activated on a machine with CUDA (parallel.device=cpu is for machines without a GPU)"
        )
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _cuda_named_type(torch.Tensor.type)
    _install_cpu_rng_tracker()
    _install_host_streams()
    _install_host_split_sizes()
    _ACTIVE = _CudaToCpuDeviceMode()
    _ACTIVE.__enter__()
    _reenter_in_custom_backward()


def _reenter_in_custom_backward() -> None:
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.apply

    def apply(self, *args):
        with _CudaToCpuDeviceMode():
            return original(self, *args)

    BackwardCFunction.apply = apply


def _cuda_named_type(original):
    def type_(self, dtype=None, *args, **kwargs):
        if dtype is not None:
            return original(self, dtype, *args, **kwargs)
        name = original(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    return type_


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mpu_random

    class CpuRNGStatesTracker(mpu_random.CudaRNGStatesTracker):
        """Named CPU generator states with the CUDA tracker's interface."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    mpu_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Recompute (CheckpointFunction) snapshots the device RNG to replay dropout in backward.
    mpu_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


class _HostStream:
    """Every CUDA stream call the MoE dispatcher makes, as no-ops: on the CPU all work is in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _install_host_streams() -> None:
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *args, **kwargs: _HOST_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _install_host_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    # The all-to-all dispatcher makes its side stream once per process (a class attribute) from whatever
    # torch.cuda.Stream is then; vLLM's CPU runner replaces torch.cuda.Stream by a placeholder whose events are
    # None, which the dispatcher then synchronizes on. Its stream is the host stream from the start.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HOST_STREAM
