"""Mixture-of-experts pieces of the actor: the router metrics of a training step, and routing replay.

Each sparse layer's router (Megatron-Core's TopKRouter) returns a [tokens, experts] routing map; a forward hook
counts the tokens each expert received while a step trains. The load of expert e is its share of the
routed tokens times the number of experts (1.0 everywhere is a perfect balance), so max/mean load is the
factor by which the busiest expert holds up its expert-parallel rank. The load-balancing loss is
Megatron's own, read from its layer-wise tracker (`moe_utils.save_to_aux_losses_tracker`), which it fills
only when the aux loss is on; it is logged without its coefficient. Tokens are counted as the router sees them:
padding included, and twice per layer under full activation recompute (the ratios are unchanged by either).

Routing replay (R3, model.routing_replay=rollout) makes each router use the experts the engine chose for the
same token (Sample.routed_experts), so that the actor computes the probabilities of the very computation
that sampled the answer. It goes through Megatron-Core's own hook for it: TopKRouter.router_replay, whose
get_replay_topk(scores, ...) returns the (scores, expert ids) the router then uses. RoutingReplay installs one
ReplayedRouting there per router, sets its target ids per micro-batch just before that micro-batch's forward
(a pipeline schedule runs several forwards before their backwards), and compares the engine's choice with the
actor's on every forward of compute_old_logprobs: router/agreement (the experts used), whether replay is on or
off. Rows without engine routing (-1: padding, a sample's last token) take the router's own choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.config.model_spec import ModelSpec
from dapo_mcore.data.types import NO_EXPERT
from dapo_mcore.mcore.sharding import unwrap
from dapo_mcore.parallel.state import ParallelContext

_AUX_LOSS = "load_balancing_loss"  # the tracker's name for the aux_loss type


def _sum_over_ranks(values: torch.Tensor, ctx: ParallelContext, sequence_parallel: bool) -> torch.Tensor:
    """Per-rank sums of per-layer counts summed over the ranks that saw other tokens or held other layers: DP and
    CP (dp_cp: each CP rank's routers saw its columns of the sequences), PP, and TP under sequence parallelism
    (without it, the TP ranks' routers saw the same tokens)."""
    groups = [ctx.pg.dp_cp] + ([ctx.pg.pp] if ctx.pp_size > 1 else [])
    if ctx.tp_size > 1 and sequence_parallel:
        groups.append(ctx.pg.tp)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
    return values.cpu()


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
        # tokens_LE[l, e]: tokens routed to expert e in layer l; calls_L[l]: router forwards of layer l that took
        # the load-balancing loss (the tracker's sum is over those: under full recompute only the recompute
        # takes it, the first forward running without grad; a padding-only micro-batch takes none)
        self.tokens_LE = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64, device=ctx.device)
        self.calls_L = torch.zeros(spec.num_layers, dtype=torch.float64, device=ctx.device)
        for layer, router in routers_of(chunks):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def count(router: torch.nn.Module, _inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if self._collecting:
                _probs, routing_map = output
                self.tokens_LE[layer] += routing_map.sum(dim=0).to(torch.float64)
                if router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled():
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
        """router/* of the collected micro-batches, the same on every rank (collective over DP, CP, PP and, with
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
        stacked = _sum_over_ranks(stacked, ctx, self._sequence_parallel)
        tokens_LE, calls_L, aux_L = stacked.split([self.tokens_LE.numel(), layers, layers])
        # each TP (under SP) and CP rank's aux loss is its tokens' share (Megatron reduces the expert counts over
        # tp_cp): summed above, so each routing call was counted once per rank of the split
        split = (ctx.tp_size if self._sequence_parallel else 1) * ctx.cp_size
        if split > 1:
            calls_L = calls_L / split
        return tokens_LE.view_as(self.tokens_LE), calls_L, aux_L if tracker is not None else None


def _same_sets(a_Nk: torch.Tensor, b_Nk: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows' top-k expert sets are equal (whatever their order)."""
    return (a_Nk.sort(dim=-1).values == b_Nk.sort(dim=-1).values).all(dim=-1)


@dataclass
class RouterTarget:
    """What one micro-batch's forward tells each router: the engine's experts of its tokens ([N, k] uint8 as the
    samples hold them, NO_EXPERT (or a negative id) where unknown; None: no engine routing), where the agreement
    is counted ([N] bool; None: nowhere), and whether the routers' load-balancing and z losses are taken. They
    are not for a micro-batch of padding only (every DP rank runs as many micro-batches, and a short share
    runs padding ones): Megatron leaves padding out of both losses and divides by the count of the rest, 0 / 0,
    NaN in every gradient of the step. The flag is the micro-batch's (its token count, the same on every TP
    rank, so every TP rank skips the same TP collective), and it travels with the micro-batch into its
    activation recompute inside backward, where a flag in the shared config would long since be restored."""

    engine_Nk: torch.Tensor | None = None
    counted_N: torch.Tensor | None = None
    losses: bool = True


class ReplayedRouting:
    """One router's per-micro-batch hook: Megatron's TopKRouter.router_replay (the RouterReplay interface minus
    its process-wide registry) and the gate of its losses (install_router_hook). A RouterTarget is set per
    micro-batch forward; each routing call begins by taking one (begin_forward): a forward takes the target set
    last; with activation recompute of the router (`recomputes`), a recompute (inside backward) takes the
    oldest, in the schedule's backward order (Megatron's REPLAY_BACKWARD rule), so every micro-batch's target
    waits for its backward; without it only the last target is kept (N x k bytes a layer, not one per
    micro-batch of the mini-batch)."""

    def __init__(self, layer: int, replay: bool, counts: AgreementCounts, recomputes: bool = True):
        self.layer, self.replay, self.counts, self.recomputes = layer, replay, counts, recomputes
        self.targets: list[RouterTarget] = []
        self.current = RouterTarget()  # the target of the routing call under way
        self._recomputing = False

    def set_target(self, target: RouterTarget) -> None:
        if not self.recomputes:
            self.targets.clear()
        self.targets.append(target)

    def clear(self) -> None:
        self.targets = []

    def begin_forward(self) -> None:
        """At the start of each routing call: take this forward's target (none set: the router's own ways)."""
        self._recomputing = torch._C._current_graph_task_id() != -1  # a recompute runs inside backward
        if not self.targets:
            self.current = RouterTarget()
        else:
            self.current = self.targets.pop(0) if self._recomputing else self.targets[-1]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_values, own_Nk = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.current.engine_Nk is None:
            return own_values, own_Nk
        engine_Nk, counted_N = self.current.engine_Nk.long(), self.current.counted_N
        known_N = ((engine_Nk >= 0) & (engine_Nk < NO_EXPERT)).all(dim=-1)
        used_Nk = torch.where(known_N[:, None], engine_Nk, own_Nk) if self.replay else own_Nk
        if not self._recomputing:
            self.counts.add(self.layer, own_Nk, used_Nk, engine_Nk, counted_N & known_N)
        if not self.replay:
            return own_values, own_Nk
        return scores.gather(1, used_Nk), used_Nk


def install_router_hook(router: torch.nn.Module, hook: ReplayedRouting) -> None:
    """Route `router` (a Megatron-Core TopKRouter, written against 0.16.1's) through `hook`: its replay hook, a
    routing call that first takes the micro-batch's target, and the losses gated by that target's flag (the
    router's own methods, shadowed on this instance only: the shared TransformerConfig is never changed)."""
    if router.get_aux_loss_coeff("global_aux_loss") > 0:  # reduced over DP: a rank alone may not skip it
        raise ValueError("the global load-balancing loss is not supported (moe_router_load_balancing_type)")
    router.router_replay = hook
    routing, aux_loss_enabled, z_loss = router.routing, router.is_aux_loss_enabled, router.apply_z_loss

    def routing_of_micro_batch(logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        hook.begin_forward()
        return routing(logits, padding_mask=padding_mask)

    def z_loss_of_micro_batch(logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return z_loss(logits, padding_mask=padding_mask) if hook.current.losses else logits

    router.routing = routing_of_micro_batch
    router.is_aux_loss_enabled = lambda: hook.current.losses and aux_loss_enabled()
    router.apply_z_loss = z_loss_of_micro_batch


class AgreementCounts:
    """Per layer, while collecting: tokens compared, and those whose top-k sets agree with the engine's (the
    experts used; the router's own choice)."""

    def __init__(self, n_layers: int, device: torch.device):
        self.counts_3L = torch.zeros(3, n_layers, dtype=torch.float64, device=device)
        self.collecting = False

    def add(self, layer: int, own_Nk, used_Nk, engine_Nk, counted_N) -> None:
        if self.collecting:
            with torch.no_grad():
                self.counts_3L[0, layer] += counted_N.sum()
                self.counts_3L[1, layer] += (_same_sets(used_Nk, engine_Nk) & counted_N).sum()
                self.counts_3L[2, layer] += (_same_sets(own_Nk, engine_Nk) & counted_N).sum()


def _recomputes_router(config: Any) -> bool:
    """Whether backward recomputes the routers' forward: full recompute, or selective recompute of the MoE
    layer or MLP."""
    modules = set(getattr(config, "recompute_modules", None) or ())
    granularity = config.recompute_granularity
    return granularity == "full" or (granularity == "selective" and bool(modules & {"moe", "mlp"}))


class RoutingReplay:
    """The replay hooks of a policy's routers, their per-micro-batch targets, and the agreement metric."""

    def __init__(self, ctx: ParallelContext, spec: ModelSpec, chunks: list[Any], replay: bool):
        self.ctx, self.replay = ctx, replay
        config = unwrap(chunks[0]).config
        if config.moe_router_fusion:  # the fused top-k returns before Megatron's replay hook
            raise ValueError("routing replay needs moe_router_fusion off")
        self._sequence_parallel = config.sequence_parallel
        self.counts = AgreementCounts(spec.num_layers, ctx.device)
        recomputes = _recomputes_router(config)
        # the hooks of each model chunk (a forward step runs one chunk), by the chunk's identity
        self.hooks: dict[int, list[ReplayedRouting]] = {}
        for chunk in chunks:
            hooks = self.hooks.setdefault(id(unwrap(chunk)), [])
            for layer, router in routers_of([chunk]):
                hooks.append(ReplayedRouting(layer, replay, self.counts, recomputes))
                install_router_hook(router, hooks[-1])

    def set_targets(
        self, model: Any, routing_bsLk: torch.Tensor | None, counted_bs: torch.Tensor | None, losses: bool = True
    ) -> None:
        """Before one micro-batch's forward on `model` (a chunk): each router's target, in its token order
        (sequence-first, this TP rank's share of the sequence under sequence parallelism; under context
        parallelism routing_bsLk is already this CP rank's columns, split with the micro-batch, and SP takes
        its TP rank's slice of those, as Megatron scatters the CP rank's sequence). counted_bs: where
        the agreement is counted (None: nowhere); losses: whether the routers' losses are taken (RouterTarget)."""
        for hook in self.hooks[id(unwrap(model))]:
            if routing_bsLk is None:
                hook.set_target(RouterTarget(losses=losses))
                continue
            engine_sbk = routing_bsLk[:, :, hook.layer].transpose(0, 1)
            if counted_bs is None:
                counted_bs = torch.zeros(routing_bsLk.shape[:2], dtype=torch.bool, device=routing_bsLk.device)
            counted_sb = counted_bs.transpose(0, 1)
            if self._sequence_parallel and self.ctx.tp_size > 1:
                engine_sbk = engine_sbk.chunk(self.ctx.tp_size)[self.ctx.tp_rank]
                counted_sb = counted_sb.chunk(self.ctx.tp_size)[self.ctx.tp_rank]
            k = engine_sbk.shape[-1]
            hook.set_target(RouterTarget(engine_sbk.reshape(-1, k), counted_sb.reshape(-1), losses))  # uint8

    def clear(self) -> None:
        """After each schedule run: forward-only runs never pop their targets."""
        for hooks in self.hooks.values():
            for hook in hooks:
                hook.clear()

    @contextmanager
    def collecting(self) -> Iterator[None]:
        self.counts.counts_3L.zero_()
        self.counts.collecting = True
        try:
            yield
        finally:
            self.counts.collecting = False

    def metrics(self) -> dict[str, float]:
        """router/agreement: the share of compared tokens (those predicting a response token of an answer of
        the current weights, with the engine's routing) whose experts in the actor's forward are the engine's,
        averaged over the sparse layers; router/agreement_unreplayed: the same for the actor's own router
        choice (equal to the first with replay off); router/agreement_tokens: tokens compared per layer. Empty
        when nothing was compared."""
        counts_3L = _sum_over_ranks(self.counts.counts_3L.clone(), self.ctx, self._sequence_parallel)
        compared_L, used_L, own_L = counts_3L
        layers = compared_L > 0
        if not layers.any():
            return {}
        return {
            "router/agreement": float((used_L[layers] / compared_L[layers]).mean()),
            "router/agreement_unreplayed": float((own_L[layers] / compared_L[layers]).mean()),
            "router/agreement_tokens": float(compared_L[layers].mean()),
        }
