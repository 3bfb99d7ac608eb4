"""The DAPO math, as pure functions of tensors: no megatron, no I/O, no .item().

Shape legend (DESIGN.md rule 7): T tokens, B samples, G groups, N samples per group, V vocab shard.
"""
