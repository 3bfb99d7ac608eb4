"""Checkpoints: HF <-> Megatron conversion maps (convert/), HF weight I/O, run checkpoints."""
