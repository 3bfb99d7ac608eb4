"""The policy being trained (and the frozen reference policy): Megatron-Core GPTModel chunks under
Megatron's schedules, DDP and optimizer.

A mini-batch of samples is dealt over the data-parallel ranks and cut into micro-batches; Megatron's
forward/backward schedule (1F1B when pipelined) runs them, our loss returns (numerator, denominator) per
micro-batch, and `calculate_per_token_loss` makes Megatron divide the gradient by the denominator summed over
all micro-batches and DP ranks: DAPO's token-level objective (paper eq. 10), or any other aggregation mode,
over the whole mini-batch whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.algo.gap_stats import add_gaps, empty_gap_summary, gap_means, gap_quantiles, gap_tokens
from dapo_mcore.algo.losses import (
    WHOLE,
    LossSettings,
    SequenceShards,
    TokenLossTerms,
    dapo_loss,
    micro_batch_keep,
    stat_keys,
    token_loss_grad,
    token_loss_terms,
)
from dapo_mcore.config.model_spec import ModelSpec
from dapo_mcore.config.schema import ModelConfig, OptimizerConfig, TrainerConfig
from dapo_mcore.data.batching import (
    DataParallelSplit,
    MicroBatch,
    block_causal_mask,
    build_micro_batch,
    build_packed_micro_batch,
    padded_length,
    padding_multiple,
    plan_packed,
    round_up,
    row_cp_columns,
    sample_tokens,
    slot_multiple,
    split_for_context_parallel,
    split_for_data_parallel,
    thd_cp_columns,
    to_sequences,
    token_budget_micro_batches,
)
from dapo_mcore.data.types import Sample
from dapo_mcore.mcore.compute_selection import compute_selection
from dapo_mcore.mcore.fused_logprobs import (
    chunked_logprobs,
    chunked_logprobs_with_loss_grad,
    install_passthrough_head,
    output_weight,
)
from dapo_mcore.mcore.logprobs import vocab_parallel_logprobs
from dapo_mcore.mcore.moe import RouterMetrics, RoutingReplay
from dapo_mcore.mcore.provider import cpu_offload_problem, padded_vocab_size
from dapo_mcore.mcore.sharding import unwrap
from dapo_mcore.parallel.state import ParallelContext, all_reduce_sums_and_maxes
from dapo_mcore.utils.errors import ConfigError, NonFiniteGradients
from dapo_mcore.utils.progress import note

_QUANTILES = (0.5, 0.9, 0.99)


PACKING_MODES = ("off", "mask", "thd")


def packing_mode(choice: str, use_te: bool) -> str:
    """trainer.packing -> the actor's mode: a block-diagonal mask with the local spec (exact, tested on the
    CPU), THD with Transformer Engine only when asked for ("on"): that path is not verified yet."""
    if choice == "off" or (choice == "auto" and use_te):
        return "off"
    return "thd" if use_te else "mask"


# The defaults are the config schema's (one set of defaults: tests/unit/test_settings_defaults.py).
_MODEL, _TRAINER, _OPTIMIZER = ModelConfig(), TrainerConfig(), OptimizerConfig()


@dataclass(frozen=True)
class ActorSettings:
    micro_batch_size: int
    temperature: float
    pad_id: int
    loss: LossSettings = LossSettings()
    # Log-probs from hidden states at response positions, chunk tokens at a time (mcore/fused_logprobs.py);
    # False: Megatron's output layer gives full logits and mcore/logprobs.py reduces them.
    fused_logprobs: bool = _MODEL.fused_logprobs
    logprob_chunk_size: int = _MODEL.logprob_chunk_size
    # With fused_logprobs, in training: the loss's per-token gradient is applied inside the head's forward
    # chunk loop (no logits recompute in backward; keeps d hidden [N, H] and d W [V/tp, H] until backward).
    fused_loss_grad: bool = _MODEL.fused_loss_grad
    # > 0: micro-batches hold at most this many (padded) tokens, and DP ranks get equal token counts;
    # 0: micro_batch_size rows each.
    max_tokens_per_micro_batch: int = _TRAINER.max_tokens_per_micro_batch
    # "off": one padded length per mini-batch; "mask": samples packed into rows (of the token budget, else of
    # the longest sample, micro_batch_size rows each) under a block-diagonal causal mask, exact with the local
    # spec; "thd": the same rows to Transformer Engine as THD with cu_seqlens (GPU; not verified here).
    packing: str = packing_mode(_TRAINER.packing, use_te=False)
    # Mixture-of-experts models: the routers use the experts the engine chose (Sample.routed_experts) where
    # known (model.routing_replay=rollout); False: their own, the agreement with the engine measured.
    routing_replay: bool = False
    # Rehearsals only (trainer.rehearsal_micro_batches): > 0 computes only this many micro-batches of a step
    # (mcore/compute_selection.py).
    rehearsal_micro_batches: int = _TRAINER.rehearsal_micro_batches

    def __post_init__(self):
        if self.packing not in PACKING_MODES:
            raise ValueError(f"packing={self.packing!r}; expected one of {PACKING_MODES}")


@dataclass
class StepBatches:
    """One RL step's data on this rank, built once on the device: the micro-batches of each mini-batch. The
    old (and reference) log-probs are written into them as tensors and the update reads them there, so they
    never leave the device as Python lists and no micro-batch is built twice."""

    samples: list[Sample]  # the whole step's samples (indices of MicroBatch.segments point into it)
    mini_batches: list[list[MicroBatch]]  # this rank's micro-batches of each optimizer update
    # Under context parallelism: the micro-batches of each mini-batch that are computed, chosen (and cut, for a
    # rehearsal) on the whole micro-batches before the split; None: the selection chooses on these.
    computed: list[list[int]] | None = None


class PolicyRunner:
    """Forward passes of GPTModel chunks through Megatron's schedules: per-token log-probs of samples."""

    def __init__(self, ctx: ParallelContext, spec: ModelSpec, chunks: list[Any], settings: ActorSettings):
        self.ctx, self.spec, self.chunks, self.settings = ctx, spec, chunks, settings
        self.config = unwrap(chunks[0]).config
        self._vocab_start = ctx.tp_rank * padded_vocab_size(spec.vocab_size, ctx.tp_size) // ctx.tp_size
        self._tp_group = ctx.pg.tp if ctx.tp_size > 1 else None
        # Sequence parallelism splits the sequence over TP ranks: lengths must divide by TP; context parallelism
        # cuts each row (THD: each packed sequence) into 2 CP chunks (data/batching.py padding_multiple).
        tp_sp = ctx.tp_size if self.config.sequence_parallel else 1
        self._multiple = padding_multiple(tp_sp, ctx.cp_size)
        self._slot = slot_multiple(tp_sp, ctx.cp_size)
        # shares of the sequences' per-sequence sums over the CP ranks (algo/losses.py SequenceShards)
        self._shards = WHOLE if ctx.cp_size == 1 else SequenceShards(sum=self._cp_sum, lead=ctx.cp_rank == 0)
        if settings.packing == "mask" and self.config.masked_softmax_fusion:
            # the fused causal softmax kernel ignores a passed mask: samples would see each other
            raise ValueError("packing with a block-diagonal mask needs masked_softmax_fusion off (the local spec)")
        self._head = unwrap(chunks[-1])  # the last model chunk holds the output layer on the last stage
        if settings.fused_logprobs and ctx.is_last_stage:
            install_passthrough_head(self._head, ctx.pg.tp)
        self.routing = RoutingReplay(ctx, spec, chunks, settings.routing_replay) if spec.is_moe else None
        self.selection = compute_selection(settings.rehearsal_micro_batches, self._multiple)

    @property
    def dp_split(self) -> DataParallelSplit:
        """How this policy deals a mini-batch to the DP ranks (the share each rank's micro-batches hold)."""
        s = self.settings
        return DataParallelSplit(
            self.ctx.dp_size,
            s.micro_batch_size,
            s.max_tokens_per_micro_batch,
            s.packing != "off",
            self._multiple,
            self._slot,
        )

    @property
    def _packing(self) -> str:
        """The packed layout: under context parallelism packed rows go THD (each sequence split per CP rank, as
        Megatron's RoPE wants; the CPU twin of CP attention takes THD), the block mask is the CP-1 CPU mode."""
        packing = self.settings.packing
        return "thd" if packing == "mask" and self.ctx.cp_size > 1 else packing

    def _cp_sum(self, partial_sums: torch.Tensor) -> torch.Tensor:
        """Detached partial sums totalled over the CP group (the ranks holding a micro-batch's other columns)."""
        total = partial_sums.detach().clone()
        dist.all_reduce(total, group=self.ctx.pg.cp)
        return total

    def prepare(self, samples: list[Sample], mini_batches: list[list[int]]) -> StepBatches:
        """This rank's micro-batches of every mini-batch (index lists into `samples`), on the device. The DP
        split and micro-batches are those of training, so each rank computes exactly what it trains on. Under
        context parallelism each micro-batch is built whole on the host, cut for a rehearsal, then split: this
        CP rank's columns go to the device."""
        seq_len = padded_length(samples, self._multiple)
        whole = [self._micro_batches(samples, indices, seq_len, place=False) for indices in mini_batches]
        if self.ctx.cp_size == 1:
            return StepBatches(samples, [[mb.to(self.ctx.device) for mb in micro] for micro in whole])
        computed = [self.selection.computed(j, micro) for j, micro in enumerate(whole)]
        placed = [
            [self._place(self.selection.cut(mb) if i in chosen else mb) for i, mb in enumerate(micro)]
            for micro, chosen in zip(whole, computed)
        ]
        return StepBatches(samples, placed, computed)

    def _place(self, mb: MicroBatch) -> MicroBatch:
        """A whole-built micro-batch on the device: this CP rank's columns of it under context parallelism."""
        if self.ctx.cp_size > 1:
            mb = split_for_context_parallel(mb, self.ctx.cp_size, self.ctx.cp_rank)
        return mb.to(self.ctx.device)

    def _computed(self, batches: StepBatches, j: int) -> list[int]:
        micro = batches.mini_batches[j]
        return self.selection.computed(j, micro) if batches.computed is None else batches.computed[j]

    @torch.no_grad()
    def logprobs_into(self, batches: StepBatches, attr: str) -> None:
        """Write this policy's log-probs of the response tokens into each micro-batch's `attr` tensor ([b, s],
        0 off the response positions, as when laid out from samples); last pipeline stage only."""
        for chunk in self.chunks:
            chunk.eval()
        for j, micro in enumerate(batches.mini_batches):
            computed = self._computed(batches, j)
            outputs = {}
            if computed:
                to_compute = [self.selection.cut(micro[i]) for i in computed]
                outputs = dict(zip(computed, self._run_schedule(to_compute, forward_only=True)))
            if self.ctx.is_last_stage:
                for i, mb in enumerate(micro):
                    logprobs_bs = self.selection.logprobs(outputs.get(i), mb)
                    setattr(mb, attr, torch.where(mb.response_mask > 0, logprobs_bs.to(mb.response_mask.dtype), 0.0))

    def fill_logprobs(self, samples: list[Sample], mini_batches: list[list[int]], attr: str) -> None:
        """Set `sample.<attr>` (a list) for the samples this rank trains on (last pipeline stage only): for
        tools and checks that read log-probs per sample; an RL step keeps them in its StepBatches."""
        batches = self.prepare(samples, mini_batches)
        self.logprobs_into(batches, attr)
        if self.ctx.is_last_stage:
            for micro in batches.mini_batches:
                _store_logprobs(samples, micro, [self._whole_row(mb, getattr(mb, attr)) for mb in micro], attr)

    def _whole_row(self, mb: MicroBatch, values_bs: torch.Tensor) -> torch.Tensor:
        """[b, full length]: a CP rank's [b, s] values of micro-batch `mb` gathered from the CP group, each rank's
        at its columns; `values_bs` itself at CP 1."""
        if mb.cp_columns is None:
            return values_bs
        cp = self.ctx.cp_size
        parts = [torch.empty_like(values_bs) for _ in range(cp)]
        dist.all_gather(parts, values_bs.contiguous(), group=self.ctx.pg.cp)
        whole = values_bs.new_zeros(values_bs.shape[0], mb.full_length)
        for rank, part in enumerate(parts):
            if mb.cu_seqlens is None:
                cols = row_cp_columns(mb.full_length, cp, rank, device=values_bs.device)
            else:
                cols = thd_cp_columns(mb.cu_seqlens, cp, rank).to(values_bs.device)
            whole[:, cols] = part
        return whole

    def _micro_batches(
        self, samples: list[Sample], indices: list[int], seq_len: int, place: bool = True
    ) -> list[MicroBatch]:
        """This rank's micro-batches of the mini-batch `indices`, built whole; on the device (this CP rank's
        columns) unless place=False."""
        built = self._whole_micro_batches(samples, indices, seq_len)
        return [self._place(mb) for mb in built] if place else built

    def _whole_micro_batches(self, samples: list[Sample], indices: list[int], seq_len: int) -> list[MicroBatch]:
        if self.settings.packing != "off":
            return self._packed_micro_batches(samples, indices)
        ctx, settings = self.ctx, self.settings
        n_most = 0  # the most micro-batches of any DP rank
        if settings.max_tokens_per_micro_batch:
            lengths = [sample_tokens(s) for s in samples]
            budget = settings.max_tokens_per_micro_batch
            by_rank = [
                token_budget_micro_batches(share, lengths, budget, self._multiple)
                for share in self.dp_split.shares(indices, lengths)
            ]
            # each DP rank packs its own share, so the counts differ (21 against 22 at the 30B-A3B recipe's
            # shape), and every rank knows them all from the shares
            n_most = max(map(len, by_rank))
            plans = [(rows, round_up(lengths[rows[0]], self._multiple)) for rows in by_rank[ctx.dp_rank]]
            if ctx.pp_size > 1:
                plans = _one_shape(plans)
        else:
            plans = [
                (rows, seq_len)
                for rows in split_for_data_parallel(indices, ctx.dp_size, ctx.dp_rank, settings.micro_batch_size)
            ]
        n_padding = self._micro_batch_count(len(plans), n_most) - len(plans)
        pad_rows = [-1] * (len(plans[0][0]) if plans and not settings.max_tokens_per_micro_batch else 1)
        plans += [(pad_rows, self._padding_length(plans[0][1] if plans else self._multiple))] * n_padding
        return [
            build_micro_batch([samples[i] if i >= 0 else None for i in rows], rows, length, settings.pad_id)
            for rows, length in plans
        ]

    def _packed_micro_batches(self, samples: list[Sample], indices: list[int]) -> list[MicroBatch]:
        """Packed rows: with a token budget one row of at most that many tokens per micro-batch, else
        micro_batch_size rows as long as the longest sample. The count: _micro_batch_count."""
        ctx, settings = self.ctx, self.settings
        budget = settings.max_tokens_per_micro_batch
        plan = plan_packed(
            indices,
            [round_up(sample_tokens(s), self._slot) for s in samples],  # each sample's slot (THD under CP)
            ctx.dp_size,
            ctx.dp_rank,
            rows_per_micro=1 if budget else settings.micro_batch_size,
            budget=budget,
            multiple=self._multiple,
        )
        # plan_packed deals every rank as many micro-batches, of empty rows where its share ran out
        mine = [rows for rows in plan.micro_batches if any(rows)]
        n_padding = self._micro_batch_count(len(mine), len(plan.micro_batches)) - len(mine)
        pad_rows = [[] for _ in plan.micro_batches[0]] if ctx.pp_size > 1 else [[]]
        plans = [(rows, plan.row_len) for rows in mine] + [(pad_rows, self._padding_length(plan.row_len))] * n_padding
        built = [
            build_packed_micro_batch(samples, rows, length, settings.pad_id, slot_multiple=self._slot)
            for rows, length in plans
        ]
        if self._packing == "thd":
            built = [_one_row(mb) for mb in built]
        return built

    def _micro_batch_count(self, n_mine: int, n_most: int) -> int:
        """How many micro-batches this rank runs, given its own and the most of any DP rank: at least one (an
        empty share still joins the schedule's collectives); under expert parallelism the most (an all-to-all
        a micro-batch across the DP ranks: a rank with one fewer would leave its partners waiting in one, as the
        30B-A3B recipe hung), else its own (dense layers reduce over DP once, after the schedule); whole groups
        of pp under the interleaved schedule. The rest of the count is padding micro-batches, without loss."""
        n = max(n_most if self.ctx.ep_size > 1 else n_mine, 1)
        if self.ctx.vpp_size > 1:
            n += -n % self.ctx.pp_size
        return n

    def _padding_length(self, common_length: int) -> int:
        """A padding micro-batch's row length: one granule where it may be short (it was as long as the rank's
        longest row, up to 22.5k tokens of compute for nothing), the common one where pipeline stages send fixed
        shapes."""
        return common_length if self.ctx.pp_size > 1 else self._multiple

    def _run_schedule(self, micro: list[MicroBatch], forward_only: bool) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        vpp = self.ctx.vpp_size
        forward_backward = get_forward_backward_func(pp_size=self.ctx.pp_size, vp_size=vpp if vpp > 1 else None)
        try:
            return forward_backward(
                forward_step_func=partial(self._forward_step, forward_only=forward_only),
                # each model chunk reads every micro-batch once (the first for tokens, the last for the loss)
                data_iterator=[iter(micro) for _ in self.chunks] if vpp > 1 else iter(micro),
                model=self.chunks,
                num_microbatches=len(micro),
                # fixed shapes for pipeline sends unless config.variable_seq_lengths (token budgets); the whole
                # row's length under context parallelism (Megatron divides it by CP: schedules.py get_tensor_shapes)
                seq_length=micro[0].full_length or micro[0].tokens.shape[1],
                micro_batch_size=micro[0].tokens.shape[0],
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
                **self._schedule_groups(),
            )
        finally:
            if self.routing is not None:  # a forward-only run never takes its routing targets back
                self.routing.clear()

    def _schedule_groups(self) -> dict[str, Any]:
        if self.ctx.pp_size == 1:
            return {"pg_collection": self.ctx.pg}
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        return {
            "pg_collection": self.ctx.pg,
            "p2p_communicator": P2PCommunicator(pp_group=self.ctx.pg.pp, config=self.config),
        }

    def _forward_step(self, data_iterator, model, forward_only: bool) -> tuple[torch.Tensor, Callable]:
        mb: MicroBatch = next(data_iterator)
        extra = {}
        if self.routing is not None:
            extra["padding_mask"] = self._padding_mask(model, mb)
            # padding only: the routers' losses would divide by its 0 tokens (moe.RouterTarget). A CP rank's share
            # may hold no real token while its peers' do: the flag is the whole micro-batch's (its samples), the
            # same on every CP rank, which reduce the routers' expert counts over TP x CP together.
            real = mb.real_tokens > 0 if mb.cp_columns is None else bool(mb.segments)
            self.routing.set_targets(model, mb.routing, mb.routing_compared, losses=real)
        output = self._forward(model, mb, extra)
        return output, partial(self._logprob_output if forward_only else self._loss, mb)

    def _forward(self, model: Any, mb: MicroBatch, extra: dict[str, Any]) -> torch.Tensor:
        if mb.segment_ids is None:
            output = model(mb.tokens, mb.position_ids, None, **extra)  # [b, s, V/tp] on the last stage; causal
        elif self._packing == "thd":
            params = thd_params(mb.segment_ids) if mb.cu_seqlens is None else cp_thd_params(mb)
            output = model(mb.tokens, mb.position_ids, None, packed_seq_params=params, **extra)
        else:
            # The local spec's layers are built causal, but its (unfused: masked_softmax_fusion is off without
            # TE) softmax uses a mask when one is passed (FusedScaleMaskSoftmax.forward_torch_softmax).
            output = model(mb.tokens, mb.position_ids, block_causal_mask(mb.segment_ids), **extra)
        return output

    def _padding_mask(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """[b, s] True at padding: the routers leave those tokens out of the load-balancing loss (else every
        padding position's gradient lands on the pad token's embedding: 20x the rest, measured). GPTModel
        splits the mask for sequence parallelism only where it embeds (the first stage); later stages get
        their slice here, as GPTModel cuts it."""
        padding = mb.padding
        if self.config.sequence_parallel and not unwrap(model).pre_process:
            from megatron.core import tensor_parallel

            padding = tensor_parallel.scatter_to_sequence_parallel_region(padding.t().contiguous()).t().contiguous()
        return padding

    def _token_logprobs(self, mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, s] log-probs and entropies of the labels; the model output is logits, or hidden states when fused."""
        if not self.settings.fused_logprobs:
            return vocab_parallel_logprobs(
                output,
                mb.labels,
                vocab_start=self._vocab_start,
                true_vocab=self.spec.vocab_size,
                temperature=self.settings.temperature,
                tp_group=self._tp_group,
            )
        rows, cols = mb.response_mask.nonzero(as_tuple=True)  # only response positions are ever scored
        logp_N, entropy_N = chunked_logprobs(
            output[rows, cols], output_weight(self._head), mb.labels[rows, cols], **self._head_kwargs()
        )
        return _to_bs(logp_N, (rows, cols), mb.labels.shape), _to_bs(entropy_N, (rows, cols), mb.labels.shape)

    def _head_kwargs(self) -> dict[str, Any]:
        return {
            "vocab_start": self._vocab_start,
            "true_vocab": self.spec.vocab_size,
            "temperature": self.settings.temperature,
            "tp_group": self._tp_group,
            "chunk": self.settings.logprob_chunk_size,
        }

    def _logprob_output(self, mb: MicroBatch, logits: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        logprobs_bs, _ = self._token_logprobs(mb, logits)
        return logprobs_bs.float()

    def _loss(self, mb: MicroBatch, logits: torch.Tensor):
        raise NotImplementedError("a frozen policy has no loss")


class MegatronActor(PolicyRunner):
    def __init__(
        self,
        ctx: ParallelContext,
        spec: ModelSpec,
        chunks: list[Any],
        optimizer: Any,
        scheduler: Any,
        settings: ActorSettings,
    ):
        super().__init__(ctx, spec, chunks, settings)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.router_metrics = RouterMetrics(ctx, spec, chunks) if spec.is_moe else None

    def offload_for_rollout(self) -> None:
        """While the engine generates: free the DDP gradient buffers (Megatron-Core's offload_grad_buffers; they
        are zeroed before the next backward anyway) and move the optimizer's state (Adam moments, and the fp32
        main parameters of a bf16 model) to host memory; then hand the freed blocks back to the driver, or
        PyTorch's cache would keep them from the engine. The model's parameters stay: the old log-probs and
        the next push need them."""
        for chunk in self.chunks:
            chunk.offload_grad_buffers(synchronize=self._on_gpu, empty_cache=False)
        # copy: a new host tensor even where the host is the device (the CPU mode), so the CPU tests run the
        # same move, swap and restore as a GPU run, and the old tensors are released either way
        self._move_optimizer_state(torch.device("cpu"), copy=True)
        if self._on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def restore_after_rollout(self) -> None:
        for chunk in self.chunks:
            chunk.restore_grad_buffers(synchronize=False)
        self._move_optimizer_state(self.ctx.device)

    @property
    def _on_gpu(self) -> bool:
        return self.ctx.device.type == "cuda"

    def _move_optimizer_state(self, device: torch.device, copy: bool = False) -> None:
        model_params = [p for chunk in self.chunks for p in chunk.parameters()]
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for opt in inner:
            if getattr(opt.config, "optimizer_cpu_offload", False):
                continue  # already kept on the host (optimizer.cpu_offload)
            for holder, key in offloadable_state(opt.optimizer, model_params):
                # a param (its group's list holds it) keeps its identity: the optimizer's state is keyed by it,
                # and the (distributed) optimizer copies its update to the model through that same object
                holder[key] = _moved(holder[key], device, copy, same_object=isinstance(holder, list))

    @property
    def sum_keys(self) -> tuple[str, ...]:
        """The per-mini-batch sums this actor reduces: loss numerator/denominator, entropy, loss statistics."""
        return (
            "loss", "denominator", "entropy", "response_tokens", "real_tokens", "computed_tokens",
            *stat_keys(self.settings.loss),
        )  # fmt: skip

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def compute_old_logprobs(self, batches: StepBatches, step: int) -> dict[str, float]:
        """Write `old_logprobs` into the step's micro-batches; return train/inference metrics (same on every rank).

        mismatch/*: samples generated at this step, with the weights the actor holds now, so any gap is the
        engine's numerics. offpolicy/*: groups carried over from earlier steps, whose gap is policy lag.
        """
        if self.routing is None:
            self.logprobs_into(batches, "old_logprobs")
            routing = {}
        else:
            _mark_routing_compared(batches, step)
            with self.routing.collecting():
                self.logprobs_into(batches, "old_logprobs")
            routing = self.routing.metrics()
        return {**self._logprob_gap_metrics(batches, step), **routing}

    def train_step(self, batches: StepBatches, step: int | None = None) -> dict[str, float]:
        """One optimizer update per mini-batch; returns the step's actor metrics (same on every rank). `step`
        (1-based) names the step in errors."""
        if self.router_metrics is None:
            return self._train_step(batches, step)
        with self.router_metrics.collecting():
            metrics = self._train_step(batches, step)
        return {**metrics, **self.router_metrics.metrics()}

    def _train_step(self, batches: StepBatches, step: int | None) -> dict[str, float]:
        totals = torch.zeros(len(self.sum_keys), dtype=torch.float64)
        grad_norms, skipped = [], 0
        for j, micro in enumerate(batches.mini_batches):
            note(f"mini-batch {j + 1}/{len(batches.mini_batches)} of the update")  # hours a step at the recipes
            computed = self._computed(batches, j)
            if not computed:  # a rehearsal's mini-batch left uncomputed: no update (the same on every rank)
                skipped += 1
                continue
            sums = self._reduce(self._gradients([self.selection.cut(micro[i]) for i in computed]))
            totals += sums
            if sums[1] == 0:  # no loss token left (all masked or guarded): an Adam step would still move
                skipped += 1
                continue
            self._refuse_non_finite_gradients(f"step {step}, update {j + 1}" if step else f"update {j + 1}")
            updated, grad_norm, _ = self.optimizer.step()
            skipped += int(not updated)
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        self.scheduler.step(increment=1)
        return self._actor_metrics(totals, grad_norms, skipped, len(batches.mini_batches))

    def _refuse_non_finite_gradients(self, where: str) -> None:
        """Before an update: every rank's gradients finite, or the run stops with one line naming the update and
        the parameters, before Adam writes a NaN weight (Megatron's optimizer steps on a NaN norm without a loss
        scaler) and the push hands it to the engine. One sum a parameter tensor (no copy of the gradients) and
        one flag all-reduced over the world a update; the names cross ranks only when a gradient is bad."""
        named = [
            (name, p.main_grad)
            for chunk in self.chunks
            for name, p in unwrap(chunk).named_parameters()
            if getattr(p, "main_grad", None) is not None
        ]
        finite_P = torch.stack([grad.sum(dtype=torch.float32) for _, grad in named]).isfinite()
        bad = (~finite_P.all()).to(torch.int32).reshape(1)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if not bad.item():
            return
        mine = [name for (name, _), finite in zip(named, finite_P.tolist()) if not finite]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        found = [f"{name} (rank {rank})" for rank, names in enumerate(every) for name in names]
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise NonFiniteGradients(
            f"{where}: gradients that are not finite (NaN or inf) in {len(found)} parameter tensors, e.g. {shown}; "
            "stopped before the update, so no such weight was written, pushed or saved (resume from the last save "
            "after finding the cause: a learning rate, a loss setting, a sample)"
        )

    def compute_gradients(self, samples: list[Sample], indices: list[int]) -> torch.Tensor:
        """Forward/backward of the mini-batch `indices` of `samples` (with their old log-probs set) into the DDP
        grad buffers; see _gradients."""
        return self._gradients(self._micro_batches(samples, indices, padded_length(samples, self._multiple)))

    def _gradients(self, micro: list[MicroBatch]) -> torch.Tensor:
        """Forward/backward of one mini-batch's micro-batches into the DDP grad buffers (`param.main_grad`),
        already divided by the mini-batch's loss denominator. Returns this rank's sums (see sum_keys), not yet
        reduced."""
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # summed where the stats are (one host copy at the end, not a GPU sync per micro-batch and key)
        totals = torch.zeros(len(self.sum_keys), dtype=torch.float64, device=self.ctx.device)
        for stats in self._run_schedule(micro, forward_only=False):
            totals += torch.stack([torch.as_tensor(stats[k], device=self.ctx.device).double() for k in self.sum_keys])
        return totals.cpu()

    def _loss(self, mb: MicroBatch, logits: torch.Tensor):
        # The loss wants one row per sample (per-sequence aggregation and masks): packed rows are regrouped.
        per_seq = partial(to_sequences, sequence_index=mb.sequence_index)
        old, adv, mask = per_seq(mb.old_logprobs), per_seq(mb.advantages), per_seq(mb.loss_mask)
        given = {"ref_logprobs_BT": per_seq(mb.ref_logprobs), "rollout_logprobs_BT": per_seq(mb.rollout_logprobs)}
        anchor = None
        # (a sequence-level loss, gspo, has no per-token gradient to take inside the head's forward)
        if (
            self.settings.fused_logprobs
            and self.settings.fused_loss_grad
            and not self.settings.loss.needs_whole_sequences
        ):
            terms = token_loss_terms(old, adv, mask, self.settings.loss, shards=self._shards, **given)
            logprobs_bs, entropy_bs, anchor = self._logprobs_with_loss_grad(mb, logits, terms)
        else:
            logprobs_bs, entropy_bs = self._token_logprobs(mb, logits)
        numerator, denominator, stats = dapo_loss(
            per_seq(logprobs_bs),
            old,
            adv,
            mask,
            self.settings.loss,
            entropy_BT=per_seq(entropy_bs),
            shards=self._shards,
            **given,
        )
        if anchor is not None:  # the log-probs carried no gradient: the numerator's comes through the anchor
            numerator = numerator + anchor * micro_batch_keep(stats, self.settings.loss, self._shards)
        stats.update(
            loss=numerator.detach(),
            denominator=denominator.detach(),
            entropy=(entropy_bs.detach() * mb.response_mask).sum(),
            response_tokens=mb.response_mask.sum(),
            real_tokens=torch.tensor(float(mb.real_tokens)),
            computed_tokens=torch.tensor(float(mb.tokens.numel())),
        )
        return numerator, denominator.round().to(torch.int), stats

    def _logprobs_with_loss_grad(self, mb: MicroBatch, hidden: torch.Tensor, terms: TokenLossTerms):
        """[b, s] log-probs and entropies (no gradient) and the head's anchor carrying d numerator / d hidden, W.

        dapo_loss's numerator is a sum of per-token terms whose constants (`terms`, in the loss's layout: one
        row per sample) are known before the forward (algo/losses.py), so the fused head takes each chunk's
        gradient in its forward (no logits recompute); it sees the same response tokens at their places in
        the micro-batch.
        """
        s = self.settings.loss
        in_sequences, (rows, cols) = _response_positions(mb)
        terms_N = terms.take(in_sequences)

        def loss_grad(a: int, b: int, logp_C: torch.Tensor, _entropy_C: torch.Tensor):
            return token_loss_grad(logp_C, terms_N.take(slice(a, b)), s)

        logp_N, entropy_N, anchor = chunked_logprobs_with_loss_grad(
            hidden[rows, cols],
            output_weight(self._head),
            mb.labels[rows, cols],
            loss_grad,
            entropy_grad=s.entropy_coeff > 0.0,  # dapo_loss's entropy term (else one [chunk, V/tp] buffer)
            **self._head_kwargs(),
        )
        shape = mb.labels.shape
        return _to_bs(logp_N, (rows, cols), shape), _to_bs(entropy_N, (rows, cols), shape), anchor

    def _reduce(self, sums: torch.Tensor) -> torch.Tensor:
        """Sums live on the last stage of each DP replica: reduce over DP x CP (CP ranks hold other columns of
        the same samples; their per-sequence counts are the lead rank's), then hand them to every stage."""
        sums = sums.to(self.ctx.device)
        dist.all_reduce(sums, group=self.ctx.pg.dp_cp)
        if self.ctx.pp_size > 1:
            dist.all_reduce(sums, group=self.ctx.pg.pp)
        return sums.cpu()

    def _actor_metrics(
        self, totals: torch.Tensor, grad_norms: list[float], skipped: int, n_updates: int
    ) -> dict[str, float]:
        t = dict(zip(self.sum_keys, totals.tolist()))
        tokens, resp = max(t["tokens"], 1.0), max(t["response_tokens"], 1.0)
        metrics = {
            "loss/policy": t["loss"] / max(t["denominator"], 1.0),
            "actor/clip_frac_high": t["clip_high"] / tokens,
            "actor/clip_frac_low": t["clip_low"] / tokens,
            "actor/ratio_above_high_neg_adv_frac": t["above_high_neg_adv"] / tokens,
            "actor/ratio_below_low_pos_adv_frac": t["below_low_pos_adv"] / tokens,
            "actor/ratio_mean": t["ratio"] / tokens,
            "actor/entropy": t["entropy"] / resp,
            "actor/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "actor/lr": self.lr,
            "actor/updates": float(n_updates - skipped),
            "actor/skipped_updates": float(skipped),
            "actor/train_tokens": t["tokens"],
            # real tokens / tokens the model computed (the rest is padding): the share of the actor's work
            # that is not wasted
            "actor/padding_efficiency": t["real_tokens"] / max(t["computed_tokens"], 1.0),
        }
        optional = {
            "dual_clip": ("actor/dual_clip_frac", tokens),
            "kl": ("actor/kl", tokens),
            "tis_weight": ("mismatch/tis_weight_mean", tokens),
            "tis_truncated": ("mismatch/tis_truncated_frac", tokens),
            "seq_masked": ("mismatch/seq_masked", 1.0),
            "token_masked": ("mismatch/token_masked_frac", tokens),
            "skipped_micro_batches": ("mismatch/skipped_micro_batches", 1.0),
        }
        for key, (name, divisor) in optional.items():
            if key in t:
                metrics[name] = t[key] / divisor
        return metrics

    def _logprob_gap_metrics(self, batches: StepBatches, step: int) -> dict[str, float]:
        """log p_actor - log p_engine of the step's response tokens: mismatch/* for the answers of this step's
        weights, offpolicy/* for older ones. Each is a fixed-size summary (algo/gap_stats.py) that the last
        stages' TP rank 0 fill (TP ranks hold the same values) and every rank sums: O(1) per rank, whatever
        the step's token count."""
        device = self.ctx.device
        fresh, stale = empty_gap_summary(device), empty_gap_summary(device)
        if self.ctx.is_last_stage and self.ctx.tp_rank == 0:
            for mb in _each_micro_batch(batches):
                fresh_bs = _fresh_response_positions(batches, mb, step)
                diff_bs = mb.old_logprobs - mb.rollout_logprobs
                add_gaps(*fresh, diff_bs[fresh_bs])
                add_gaps(*stale, diff_bs[(mb.response_mask > 0) & ~fresh_bs])
        sums_2S, extremes_23 = torch.stack([fresh[0], stale[0]]), torch.stack([fresh[1], stale[1]])
        all_reduce_sums_and_maxes(sums_2S, extremes_23)
        return {
            **_gap_metrics(sums_2S[0], extremes_23[0], "mismatch"),
            **_gap_metrics(sums_2S[1], extremes_23[1], "offpolicy"),
        }


def _each_micro_batch(batches: StepBatches) -> Iterator[MicroBatch]:
    return (mb for micro in batches.mini_batches for mb in micro)


def _placed_samples(batches: StepBatches, mb: MicroBatch) -> Iterator[tuple[Sample, int, int]]:
    """Each sample of micro-batch `mb` with where it sits: (sample, row, token offset of its first token)."""
    return ((batches.samples[index], row, offset) for index, row, offset in mb.segments)


def _fresh_response_positions(batches: StepBatches, mb: MicroBatch, step: int) -> torch.Tensor:
    """[b, s] bool: the positions predicting a response token of an answer generated by this step's weights
    (a carried-over or continued answer began under older ones)."""
    b = mb.response_mask.shape[0]
    fresh = torch.zeros(b, mb.full_length or mb.response_mask.shape[1], dtype=torch.bool, device=mb.tokens.device)
    for sample, row, offset in _placed_samples(batches, mb):
        if sample.policy_step == step:
            fresh[row, offset : offset + sample_tokens(sample)] = True
    if mb.cp_columns is not None:  # a CP rank's columns of the whole row (segments are the whole row's)
        fresh = fresh[:, mb.cp_columns]
    return fresh & (mb.response_mask > 0)


def _mark_routing_compared(batches: StepBatches, step: int) -> None:
    """Set each micro-batch's routing_compared: where the routing agreement is counted (as mismatch/: a
    carried-over answer's routing is that of older weights)."""
    for mb in _each_micro_batch(batches):
        mb.routing_compared = _fresh_response_positions(batches, mb, step)


def offloadable_state(optimizer: Any, model_params: list[torch.Tensor]) -> list[tuple[Any, Any]]:
    """(container, key) of each optimizer tensor that may leave the device while the engine generates: every
    state tensor (Adam's moments), and each optimized parameter that is a copy of its own (the fp32 main
    parameters of a bf16 model). Not those sharing storage with the model's parameters (an fp32 model's main
    parameters under the distributed optimizer are views of its parameter buffer): moving them would cut the
    link the optimizer writes the update through (why Megatron's own optimizer.offload_to_cpu is not used)."""
    model_storages = {p.untyped_storage().data_ptr() for p in model_params}
    found = []
    for state in optimizer.state.values():
        found += [(state, key) for key, value in state.items() if isinstance(value, torch.Tensor) and value.dim() > 0]
    for group in optimizer.param_groups:
        params = group["params"]
        found += [
            (params, i) for i, p in enumerate(params) if p.untyped_storage().data_ptr() not in model_storages
        ]  # fmt: skip
    return found


def _moved(tensor: torch.Tensor, device: torch.device, copy: bool = False, same_object: bool = False) -> torch.Tensor:
    """`tensor` on `device` (a new tensor with copy=True, even where it already is). same_object: the same
    Python object with its `.data` swapped. Megatron's fp32 main params are plain tensors, not Parameters
    (`param.detach().clone().float()` in both optimizers): the caller must say so, their type cannot."""
    if tensor.device == device and not copy:
        return tensor
    if same_object:
        tensor.data = tensor.data.to(device, non_blocking=True, copy=copy)
        return tensor
    return tensor.to(device, non_blocking=True, copy=copy)


def _gap_metrics(sums_S: torch.Tensor, extremes_3: torch.Tensor, prefix: str) -> dict[str, float]:
    """|logp_train - logp_rollout| over response tokens (mean, max), the k3 estimate of KL(engine || actor)
    on the engine's samples, and the ratio exp(train - rollout): its extremes and quantiles (from the
    summary's histogram: within about 1% of the gap, algo/gap_stats.py)."""
    if gap_tokens(sums_S) == 0:
        return {}
    abs_mean, k3_mean = gap_means(sums_S)
    metrics = {
        f"{prefix}/abs_logp_diff_mean": abs_mean,
        f"{prefix}/abs_logp_diff_max": float(extremes_3[0]),
        f"{prefix}/k3_kl": k3_mean,
        f"{prefix}/ratio_max": math.exp(float(extremes_3[1])),
        f"{prefix}/ratio_min": math.exp(-float(extremes_3[2])),
    }
    if math.isnan(k3_mean):  # a NaN log-prob (the mismatch guard names it): its quantiles mean nothing
        return metrics
    for q, ratio in zip(_QUANTILES, gap_quantiles(sums_S, extremes_3, _QUANTILES, of=math.exp)):
        metrics[f"{prefix}/ratio_p{round(q * 100)}"] = ratio
    return metrics


def _response_positions(mb: MicroBatch) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The response tokens as (sample, position) in the loss's one-row-per-sample layout and, in the same
    order, as (row, column) in the micro-batch (the same pairs when rows are not packed)."""
    in_sequences = to_sequences(mb.response_mask, mb.sequence_index).nonzero(as_tuple=True)
    if mb.sequence_index is None:
        return in_sequences, in_sequences
    return in_sequences, (mb.sequence_index[0][in_sequences], mb.sequence_index[1][in_sequences])


def _to_bs(values_N: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """[b, s] with values_N at the response positions `index`, 0 elsewhere."""
    return values_N.new_zeros(shape).index_put(index, values_N)


def _one_shape(plans: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    """Pad (rows, length) plans to one shape: pipeline stages then send fixed-shape tensors.

    Megatron's variable-shape p2p (config.variable_seq_lengths) exchanges shapes with one batched
    isend/irecv; at PP=2 a rank's previous and next stage are the same peer, and on gloo the two shape
    messages were paired the wrong way round. Padding rows carry no loss, so only compute is spent.
    """
    rows_max, length_max = max(len(rows) for rows, _ in plans), max(length for _, length in plans)
    return [(rows + [-1] * (rows_max - len(rows)), length_max) for rows, _ in plans]


def _one_row(mb: MicroBatch) -> MicroBatch:
    """Packed rows laid end to end as one row: THD attention takes [1, total tokens] with cu_seqlens."""
    flat = {k: (v.reshape(1, -1) if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in vars(mb).items()}
    if mb.routing is not None:  # [b, s, layers, k] -> [1, b * s, layers, k]
        flat["routing"] = mb.routing.reshape(1, -1, *mb.routing.shape[2:])
    s = mb.tokens.shape[1]
    flat["segments"] = [(i, 0, row * s + offset) for i, row, offset in mb.segments]
    index = mb.sequence_index.clone()
    flat["sequence_index"] = torch.stack([torch.zeros_like(index[0]), index[0] * s + index[1]])
    return MicroBatch(**flat)


def thd_params(segment_ids_bs: torch.Tensor) -> Any:
    """PackedSeqParams (THD) for one row of consecutive segments: cumulative segment lengths."""
    from megatron.core.packed_seq_params import PackedSeqParams

    _, counts = torch.unique_consecutive(segment_ids_bs.reshape(-1), return_counts=True)
    cu_seqlens = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(counts.max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def cp_thd_params(mb: MicroBatch) -> Any:
    """PackedSeqParams (THD) of a CP rank's share of a packed row: the whole row's cu_seqlens and longest
    sequence (Megatron's RoPE and Transformer Engine split them per CP rank themselves; the pads of each slot are
    the sequence's tail, so the padded lengths are the same)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = mb.cu_seqlens.to(device=mb.tokens.device, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )


def _store_logprobs(samples: list[Sample], micro: list[MicroBatch], outputs: list[torch.Tensor], attr: str) -> None:
    for mb, logprobs_bs in zip(micro, outputs):
        for index, row, offset in mb.segments:
            sample = samples[index]
            start = offset + len(sample.prompt_ids) - 1
            setattr(sample, attr, logprobs_bs[row, start : start + len(sample.response_ids)].tolist())


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    use_distributed_optimizer: bool
    cpu_offload: bool = _OPTIMIZER.cpu_offload
    offload_fraction: float = _OPTIMIZER.offload_fraction


def build_actor(
    ctx: ParallelContext, spec: ModelSpec, chunks: list[Any], opt: OptimizerSettings, settings: ActorSettings
) -> MegatronActor:
    """Wrap loaded model chunks in Megatron's DDP and build its optimizer and LR schedule.

    Weights must already be in `chunks`: the distributed optimizer copies them into its main parameters.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=opt.use_distributed_optimizer
    )
    ddp_chunks = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, pg_collection=ctx.pg)
        for chunk in chunks
    ]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp_chunks[0].no_sync if len(ddp_chunks) == 1 else [c.no_sync for c in ddp_chunks]
    if opt.cpu_offload and (problem := cpu_offload_problem(ctx.is_cpu)):
        raise ConfigError(problem)
    optimizer = get_megatron_optimizer(OptimizerConfig(**megatron_optimizer_options(opt, config)), ddp_chunks)
    return MegatronActor(ctx, spec, ddp_chunks, optimizer, _lr_schedule(optimizer, opt), settings)


def megatron_optimizer_options(opt: OptimizerSettings, config: Any) -> dict[str, Any]:
    """Megatron's OptimizerConfig for `opt` and the model's TransformerConfig. optimizer.cpu_offload goes through
    the precision-aware path, as Megatron-LM's own argument check requires: without it the distributed
    optimizer keeps an fp32 copy of every parameter shard on the GPU (shard_main_param) beside the host
    copies the hybrid optimizer steps (14.2 GiB a GPU at 30B-A3B); with it the main parameters live only in
    the HybridDeviceOptimizer (its GPU share in fp32, param_update_in_fp32), as plan.py counts them."""
    return dict(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=opt.use_distributed_optimizer,
        optimizer_cpu_offload=opt.cpu_offload,
        optimizer_offload_fraction=opt.offload_fraction if opt.cpu_offload else 0.0,
        use_precision_aware_optimizer=opt.cpu_offload,
    )


def build_reference(ctx: ParallelContext, spec: ModelSpec, chunks: list[Any], settings: ActorSettings) -> PolicyRunner:
    """A frozen policy (the KL reference) on already-loaded chunks: no DDP, no optimizer, no gradients."""
    for chunk in chunks:
        chunk.requires_grad_(False)
    return PolicyRunner(ctx, spec, chunks, settings)


def _lr_schedule(optimizer: Any, opt: OptimizerSettings) -> Any:
    """Linear warm-up over `warmup_steps` RL steps, then constant (the paper). Stepped once per RL step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.warmup_steps,
        lr_decay_steps=max(opt.total_steps, opt.warmup_steps + 1),
        lr_decay_style="constant",
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=max(opt.total_steps, 1),
        wd_incr_style="constant",
    )
    # Megatron's warm-up gives lr = 0 at step 0; start one step in so the first RL step already learns.
    scheduler.step(increment=1)
    return scheduler
