"""The Megatron-Core actor: model provider, vocab-parallel log-probs, forward/backward with Megatron's
schedules, DDP and optimizer."""
