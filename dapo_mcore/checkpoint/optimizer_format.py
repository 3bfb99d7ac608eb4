"""The distributed optimizer's part of a run checkpoint: its format (`checkpoint.optimizer_format`), the layouts
a save in it reloads at, and the workarounds its load needs in Megatron-Core 0.16.1 on the native torch Adam.

- `dp_reshardable` (the default, Megatron-LM's own for routine saves): each rank writes its own share of its
  data-parallel group's buckets, nothing is gathered, and each rank reads back only its share; it reloads at
  another data-parallel size, but not at another TP / PP / EP / VPP (refused with one line naming the layouts).
- `fully_reshardable`: the canonical per-parameter form, which reloads at any layout. Making it gathers each
  data-parallel group's whole state (over gloo, in host memory of the group's first rank: Megatron's
  memory-efficient path), and loading it reads the whole group's state on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.utils.errors import CheckpointError

BEFORE_FORMATS = "fully_reshardable"  # saves made before checkpoint.optimizer_format existed


def optimizer_state(actor: Any, model_sd: dict[str, Any], optimizer_format: str, is_loading: bool = False) -> Any:
    """The optimizer's part of a save (or of a load's request) in `optimizer_format`."""
    metadata = {
        "distrib_optim_sharding_type": optimizer_format,
        # fully_reshardable: gather over gloo onto each DP group's first rank, not NCCL onto every rank's GPU
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }
    return actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)


def refuse_other_layout(path: Path, saved: dict[str, Any], layout: dict[str, int], optimizer_format: str) -> None:
    """A dp_reshardable save reloads at another data-parallel or context-parallel size only: the distributed
    optimizer shards over DP x CP (Megatron's dp_cp group), and CP changes no weight's layout."""
    if optimizer_format != "dp_reshardable":
        return
    resharded = ("dp", "cp")  # a save made before CP records none: CP 1
    fixed = {key: value for key, value in saved.items() if key not in resharded}
    if fixed == {key: value for key, value in layout.items() if key not in resharded}:
        return
    raise CheckpointError(
        f"checkpoint {path} holds the optimizer state per data-parallel rank (checkpoint.optimizer_format="
        f"dp_reshardable), which reloads at another DP or CP size only: it was saved at {saved}, this run is {layout}; "
        "resume at the saved layout (any DP size), run one step there with checkpoint.optimizer_format="
        "fully_reshardable and checkpoint.save_interval=1, and resume that save at the new layout"
    )


def allocate_optimizer_state(optimizer: Any) -> None:
    """Give a torch Adam that has not stepped yet its (zero) state, step counter included.

    Megatron's distributed optimizer builds the loading template from `state_dict()`, which on the native
    torch Adam path (no Apex/TE) reads every parameter's `step`; a fresh optimizer has none, and Megatron's own
    `init_state_fn` sets only the moments. Every value set here is overwritten by the load."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


@contextmanager
def adam_step_fixed(optimizer: Any) -> Iterator[None]:
    """Work around two bugs of Megatron-Core 0.16.1 on the native torch Adam path (no Apex/TE: every CPU run).

    Its distributed optimizer stores Adam's `step` once per param group and on loading sets it back as ONE
    tensor shared by every parameter's state; then it copies "every key of that state" from the checkpoint's
    per-parameter tensors, which hold no `step` (KeyError at any layout). Here the copy is given the step it
    already set, and afterwards each parameter gets its own step tensor: torch's Adam increments it in place,
    so a shared one advances by the number of parameters per update and bias correction goes wrong (a
    resumed run then drifts from the uninterrupted one from its second update on)."""
    patched = [
        sub
        for sub in getattr(optimizer, "chained_optimizers", [optimizer])
        if hasattr(sub, "model_param_group_index_map") and hasattr(sub, "_set_main_param_and_optimizer_states")
    ]
    for sub in patched:
        sub._set_main_param_and_optimizer_states = functools.partial(
            _set_states_keeping_step, sub, type(sub)._set_main_param_and_optimizer_states
        )
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states  # back to the class's method
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in getattr(getattr(sub, "optimizer", None), "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _set_states_keeping_step(sub: Any, original: Any, model_param: Any, tensors: dict[str, Any]) -> None:
    group_index, group_order = sub.model_param_group_index_map[model_param]
    state = sub.optimizer.state[sub.optimizer.param_groups[group_index]["params"][group_order]]
    if "step" in state:  # dp_reshardable's per-parameter step tensors load as 0 (0-dim, bucketed): not used
        tensors = {**tensors, "step": state["step"]}
    original(sub, model_param, tensors)
