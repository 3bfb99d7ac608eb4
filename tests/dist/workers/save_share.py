"""Worker for the save-share test (2 ranks, data parallel, run under torchrun): how many bytes of tensors the
optimizer's part of a save holds on this rank, in each optimizer format, against the optimizer state the rank
itself keeps (its share of Adam's moments and of the fp32 weights).

    torchrun --nproc_per_node 2 save_share.py HF_DIR OUT [--saves ROOT]

Result (OUT.rank<R>): {"own": bytes the rank's optimizer holds, "routine": bytes the state of a save with the
default checkpoint settings holds, "fully_reshardable": the same in that format}; with --saves also
"distributions": after each of three saves into ROOT through the run's CheckpointManager (the second of the same
structure as the first, the third in the other optimizer format), how many times the save distribution was
computed, and "reloaded": whether the second save loads back to the same weights.
"""

import argparse

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from dapo_mcore.checkpoint.model_checkpoint import model_sharded_state_dict
from dapo_mcore.checkpoint.optimizer_format import allocate_optimizer_state, optimizer_state
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.config.schema import CheckpointConfig
from dapo_mcore.mcore.actor import ActorSettings, OptimizerSettings, build_actor
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config
from dapo_mcore.parallel import destroy_parallel, init_parallel


def tensor_bytes(tree) -> int:
    """Bytes of every distinct tensor storage in a (sharded) state dict, each counted once."""
    seen, total = set(), 0
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, ShardedTensor):
            stack.append(item.data)
        elif torch.is_tensor(item) and item.numel() > 1:  # not the 0-dim step counters
            key = (item.untyped_storage().data_ptr(), item.storage_offset(), item.numel())
            if key not in seen:
                seen.add(key)
                total += item.numel() * item.element_size()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--saves", default="")
    args = ap.parse_args()
    ctx = init_parallel(1, 1, "cpu")
    spec = read_model_spec(load_hf_config(args.hf_dir))
    config = build_transformer_config(spec, tp=1, pp=1, dtype="float32", on_cpu=True, use_te=False)
    chunks = build_gpt_chunks(spec, config, ctx=ctx, use_te=False)
    opt = OptimizerSettings(
        lr=1e-3, min_lr=0.0, warmup_steps=0, total_steps=4, weight_decay=0.0, clip_grad=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=True,
    )  # fmt: skip
    actor = build_actor(ctx, spec, chunks, opt, ActorSettings(micro_batch_size=8, temperature=1.0, pad_id=0))
    allocate_optimizer_state(actor.optimizer)
    inner = actor.optimizer.optimizer
    own = tensor_bytes([list(inner.state.values()), [g["params"] for g in inner.param_groups]])
    result = {"own": own}
    routine = CheckpointConfig().optimizer_format  # what every save of a run with the defaults writes
    for name, optimizer_format in (("routine", routine), ("fully_reshardable", "fully_reshardable")):
        model_sd = model_sharded_state_dict(actor.chunks)
        result[name] = tensor_bytes(optimizer_state(actor, model_sd, optimizer_format))
    if args.saves:
        result.update(saves_and_distributions(ctx, spec, actor, args.saves))
    torch.save(result, f"{args.out}.rank{torch.distributed.get_rank()}")
    destroy_parallel()


def saves_and_distributions(ctx, spec, actor, root: str) -> dict:
    from pathlib import Path
    from unittest import mock

    from megatron.core.dist_checkpointing.strategies import fully_parallel

    from dapo_mcore.checkpoint.run_checkpoint import CheckpointManager

    computed, counts = [], []
    real = fully_parallel.determine_main_replica_uniform_distribution

    def counting(*args, **kwargs):
        computed.append(1)
        return real(*args, **kwargs)

    manager = CheckpointManager(root, ctx, keep_last=5)
    before = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    with mock.patch.object(fully_parallel, "determine_main_replica_uniform_distribution", counting):
        for step in (1, 2, 3):
            if step == 3:
                manager.optimizer_format = "fully_reshardable"
            manager.save(step, actor, spec, {"consumed": step}, background=False)
            counts.append(len(computed))
    manager.optimizer_format = "dp_reshardable"
    with torch.no_grad():
        for p in actor.chunks[0].parameters():
            p.add_(1.0)
    manager.load(Path(root) / "step_000002", actor, spec)
    reloaded = all(torch.equal(before[n], p) for n, p in actor.chunks[0].named_parameters())
    return {"distributions": counts, "reloaded": reloaded}


if __name__ == "__main__":
    main()
