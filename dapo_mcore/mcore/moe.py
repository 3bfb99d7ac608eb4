"""Mixture-of-experts pieces of the actor: the router metrics of a training step.

Each sparse layer's router (Megatron-Core's TopKRouter) returns a [tokens, experts] routing map; a forward hook
counts the tokens each expert received while a step trains. The load of expert e is its share of the
routed tokens times the number of experts (1.0 everywhere is a perfect balance), so max/mean load is the
factor by which the busiest expert holds up its expert-parallel rank. The load-balancing loss is
Megatron's own, read from its layer-wise tracker (`moe_utils.save_to_aux_losses_tracker`), which it fills
only when the aux loss is on; it is logged without its coefficient. Tokens are counted as the router sees them:
padding included, and twice per layer under full activation recompute (the ratios are unchanged by either).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.config.model_spec import ModelSpec
from dapo_mcore.mcore.sharding import unwrap
from dapo_mcore.parallel.state import ParallelContext

_AUX_LOSS = "load_balancing_loss"  # the tracker's name for the aux_loss type


def routers_of(chunks: list[Any]) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of every sparse layer of this rank's chunks."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        (module.layer_number - 1, module)
        for chunk in chunks
        for module in unwrap(chunk).modules()
        if isinstance(module, TopKRouter)
    ]


class RouterMetrics:
    """Expert load and load-balancing loss per sparse layer over the micro-batches of `collecting()`."""

    def __init__(self, ctx: ParallelContext, spec: ModelSpec, chunks: list[Any]):
        self.ctx, self.spec = ctx, spec
        self._sequence_parallel = unwrap(chunks[0]).config.sequence_parallel
        self._collecting = False
        # tokens_LE[l, e]: tokens routed to expert e in layer l; calls_L[l]: router forwards of layer l
        self.tokens_LE = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64, device=ctx.device)
        self.calls_L = torch.zeros(spec.num_layers, dtype=torch.float64, device=ctx.device)
        for layer, router in routers_of(chunks):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def count(_module: torch.nn.Module, _inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if self._collecting:
                _probs, routing_map = output
                self.tokens_LE[layer] += routing_map.sum(dim=0).to(torch.float64)
                self.calls_L[layer] += 1

        return count

    @contextmanager
    def collecting(self) -> Iterator[None]:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.tokens_LE.zero_()
        self.calls_L.zero_()
        clear_aux_losses_tracker()
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    def metrics(self) -> dict[str, float]:
        """router/* of the collected micro-batches, the same on every rank (collective over DP, PP and, with
        sequence parallelism, TP: every rank's routers saw other tokens, or other layers)."""
        tokens_LE, calls_L, aux_L = self._reduced()
        out: dict[str, float] = {}
        ratios, aux = [], []
        for layer in (i for i, sparse in enumerate(self.spec.moe_layers) if sparse):
            total = tokens_LE[layer].sum()
            if total == 0:
                continue
            load_E = tokens_LE[layer] / total * self.spec.num_experts
            ratios.append(float(load_E.max()))
            out[f"router/layer_{layer:02d}/load_max_over_mean"] = ratios[-1]
            out[f"router/layer_{layer:02d}/load_min_over_mean"] = float(load_E.min())
            if aux_L is not None and calls_L[layer] > 0:
                aux.append(float(aux_L[layer] / calls_L[layer]))
                out[f"router/layer_{layer:02d}/aux_loss"] = aux[-1]
        if ratios:
            out["router/load_max_over_mean"] = sum(ratios) / len(ratios)
            out["router/load_max_over_mean_worst"] = max(ratios)
        if aux:
            out["router/aux_loss"] = sum(aux) / len(aux)
        return out

    def _reduced(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens_LE, calls_L, aux_L) summed over the ranks; aux_L None when the aux loss is off."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        ctx, layers = self.ctx, self.spec.num_layers
        tracker = get_moe_layer_wise_logging_tracker().get(_AUX_LOSS)
        aux_L = torch.zeros_like(self.calls_L)
        if tracker is not None:
            aux_L += tracker["values"][:layers].to(aux_L)
        # per-rank sums, in one tensor for one collective per group; other stages' layers are zeros here
        stacked = torch.cat([self.tokens_LE.flatten(), self.calls_L, aux_L])
        groups = [ctx.pg.dp] + ([ctx.pg.pp] if ctx.pp_size > 1 else [])
        over_tp = ctx.tp_size > 1 and self._sequence_parallel
        for group in groups + ([ctx.pg.tp] if over_tp else []):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(stacked, group=group)
        tokens_LE, calls_L, aux_L = stacked.cpu().split([self.tokens_LE.numel(), layers, layers])
        if over_tp:  # each TP rank's aux loss is its tokens' share: summed, not averaged, over TP
            calls_L = calls_L / ctx.tp_size
        return tokens_LE.view_as(self.tokens_LE), calls_L, aux_L if tracker is not None else None
