"""Actor -> engines: the only bridge between the Megatron actor and the rollout engines.

Every rank hosts an engine replica, so every rank needs the full HF-named weights. Per pipeline stage, in
stage order: the stage's ranks all-gather each tensor over TP, pack the full tensors into buckets of about
`bucket_bytes`, and broadcast each bucket from that stage to the other stages of the pipeline. Every rank
runs the same collectives in the same order, so no rank can wait on a collective another never enters.
With expert parallelism a stage's experts are spread over its EP ranks: each expert bucket is gathered over
the expert TP group on the EP rank that holds it and broadcast over the EP group first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.mcore.sharding import gather_full, global_named_parameters, is_expert_param, tp_split_of
from dapo_mcore.parallel.state import ParallelContext, all_gather_objects
from dapo_mcore.rollout.base import RolloutEngine
from dapo_mcore.weight_sync.verify import checksums, verified


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # The EP rank holding this expert parameter; None: not an expert's (every EP rank holds it).
    ep_owner: int | None = None

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class PushStats:
    tensors: int = 0
    nbytes: int = 0

    def counted(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            self.tensors += 1
            self.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor


class WeightExporter:
    def __init__(
        self, ctx: ParallelContext, chunks: list[torch.nn.Module], family: LlamaFamilyMap, bucket_bytes: int = 512 << 20
    ):
        self.ctx, self.chunks, self.family, self.bucket_bytes = ctx, chunks, family, bucket_bytes
        self._local = [
            (n, p) for chunk in chunks for n, p in global_named_parameters(chunk) if not self._is_tied_copy(n)
        ]
        self._params = dict(self._local)
        mine = self._stage_entries()
        # The same ordered list of every stage's entries on every rank.
        self._stages: list[list[_Entry]] = all_gather_objects(mine, group=ctx.pg.pp) if ctx.pp_size > 1 else [mine]

    def _stage_entries(self) -> list[_Entry]:
        """This stage's entries: the shared parameters, then every EP rank's experts in EP rank order."""
        owner = self.ctx.ep_rank if self.ctx.ep_size > 1 else None
        shared = [_Entry(n, self._full_shape(n, p), p.dtype) for n, p in self._local if not is_expert_param(n)]
        experts = [_Entry(n, self._full_shape(n, p), p.dtype, owner) for n, p in self._local if is_expert_param(n)]
        if self.ctx.ep_size > 1:
            experts = [e for rank_entries in all_gather_objects(experts, group=self.ctx.pg.ep) for e in rank_entries]
        return shared + experts

    def hf_weights(self, grads: bool = False, verify: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) for the whole model, on every rank. With grads=True, the gradients
        (Megatron DDP's `main_grad`) instead of the weights, e.g. to compare parallel layouts. With
        verify=True, each tensor is checked against the checksum its owning stage took (weight_sync/verify.py)."""
        for stage, entries in enumerate(self._stages):
            for bucket in self._buckets(entries, grads):
                if verify:
                    named, sums = self._verified_bucket(stage, bucket, grads)
                    yield from verified(named, sums)
                else:
                    yield from self._hf_bucket(bucket, self._materialise(stage, bucket, grads))

    def push(self, engine: RolloutEngine, verify: bool = False) -> PushStats:
        """Every weight to the engine; with verify, each checked against its owner's checksum as the engine
        takes it (a mismatch raises). Returns what the engine took."""
        stats = PushStats()
        engine.update_weights(stats.counted(self.hf_weights(verify=verify)))
        return stats

    def _hf_bucket(self, bucket: list[_Entry], tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [pair for entry, tensor in zip(bucket, tensors) for pair in self.family.mcore_to_hf(entry.name, tensor)]

    def _verified_bucket(
        self, stage: int, bucket: list[_Entry], grads: bool
    ) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
        """The bucket as HF tensors on this rank, and the checksums its owning stage took of them."""
        ctx = self.ctx
        owner = stage == ctx.pp_rank
        gathered = self._gathered(bucket, grads) if owner else None
        sums = checksums(self._hf_bucket(bucket, gathered)) if owner else []
        named = self._hf_bucket(bucket, self._materialise(stage, bucket, grads, gathered))
        if ctx.pp_size > 1:  # the owner's checksums travel with the bucket
            sums_t = torch.tensor(sums or [0] * len(named), dtype=torch.int64, device=ctx.device)
            dist.broadcast(sums_t, src=ctx.pp_global_ranks[stage], group=ctx.pg.pp)
            sums = sums_t.tolist()
        return named, sums

    def _local_tensor(self, name: str, grads: bool) -> torch.Tensor:
        param = self._params[name]
        return param.main_grad.float() if grads else param.detach()

    def _is_tied_copy(self, name: str) -> bool:
        return name == "output_layer.weight" and self.family.spec.tie_word_embeddings

    def _full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        split = tp_split_of(name, param)
        shape = list(param.shape)
        if split.dim is not None:
            shape[split.dim] *= self.ctx.etp_size if split.expert else self.ctx.tp_size
        if split.vocab:
            shape[0] = self.family.spec.vocab_size
        return tuple(shape)

    def _buckets(self, entries: list[_Entry], grads: bool) -> Iterator[list[_Entry]]:
        bucket, size = [], 0
        for entry in entries:
            if grads:  # main_grad buffers are fp32 whatever the parameter dtype
                entry = replace(entry, dtype=torch.float32)
            nbytes = entry.numel * entry.dtype.itemsize
            if bucket and (size + nbytes > self.bucket_bytes or entry.ep_owner != bucket[-1].ep_owner):
                yield bucket
                bucket, size = [], 0
            bucket.append(entry)
            size += nbytes
        if bucket:
            yield bucket

    @torch.no_grad()
    def _gathered(self, bucket: list[_Entry], grads: bool) -> list[torch.Tensor]:
        """This stage's full (TP-gathered) tensors of the bucket, on every rank of the stage."""
        ctx = self.ctx
        owner = bucket[0].ep_owner
        if owner is not None and owner != ctx.ep_rank:
            return self._from_ep_owner(bucket, owner, None)
        groups = {False: ctx.pg.tp if ctx.tp_size > 1 else None, True: ctx.pg.expt_tp if ctx.etp_size > 1 else None}
        tensors = []
        for e in bucket:
            split = tp_split_of(e.name, self._params[e.name])
            tensors.append(
                gather_full(self._local_tensor(e.name, grads), split, groups[split.expert], self.family.spec.vocab_size)
            )
        return tensors if owner is None else self._from_ep_owner(bucket, owner, tensors)

    def _from_ep_owner(
        self, bucket: list[_Entry], owner: int, tensors: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """An expert bucket broadcast over the EP group from the EP rank that holds it."""
        ctx = self.ctx
        if tensors is not None:
            flat = torch.cat([t.reshape(-1).to(bucket[0].dtype) for t in tensors])
        else:
            flat = torch.empty(sum(e.numel for e in bucket), dtype=bucket[0].dtype, device=ctx.device)
        dist.broadcast(flat, src=dist.get_process_group_ranks(ctx.pg.ep)[owner], group=ctx.pg.ep)
        return [piece.view(e.shape) for piece, e in zip(flat.split([e.numel for e in bucket]), bucket)]

    @torch.no_grad()
    def _materialise(
        self, stage: int, bucket: list[_Entry], grads: bool, gathered: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The bucket's full tensors on every rank: gathered on its stage, broadcast to the other stages."""
        ctx = self.ctx
        if len({e.dtype for e in bucket}) > 1:
            raise TypeError("a weight bucket mixes dtypes; all parameters of a chunk share one dtype")
        if stage == ctx.pp_rank:
            tensors = gathered if gathered is not None else self._gathered(bucket, grads)
            if ctx.pp_size == 1:
                return tensors
            flat = torch.cat([t.reshape(-1) for t in tensors])
        else:
            flat = torch.empty(sum(e.numel for e in bucket), dtype=bucket[0].dtype, device=ctx.device)
        dist.broadcast(flat, src=ctx.pp_global_ranks[stage], group=ctx.pg.pp)
        return [piece.view(e.shape) for piece, e in zip(flat.split([e.numel for e in bucket]), bucket)]
