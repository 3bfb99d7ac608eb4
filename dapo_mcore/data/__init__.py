"""Prompts (generated or from files), the shipped tokenizer, rollout sample types, micro-batch packing."""
