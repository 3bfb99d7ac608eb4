"""Pure per-parameter HF <-> Megatron-Core name maps, one module per model family."""

from dapo_mcore.checkpoint.convert.llama import LlamaFamilyMap

__all__ = ["LlamaFamilyMap"]
