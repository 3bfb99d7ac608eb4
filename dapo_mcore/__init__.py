"""dapo_mcore: DAPO reinforcement learning of LLMs on Megatron-Core.

Importing the package imports no heavy dependency (megatron, transformer_engine, vllm, sglang); those are
loaded by the subpackages that need them, when they need them.
"""

__version__ = "0.1.0"
