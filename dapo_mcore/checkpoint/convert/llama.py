"""HF <-> Megatron-Core name maps for Llama-style decoders (llama, qwen2, qwen3).

Pure per-parameter maps on full (unsharded) tensors, each rule with its inverse (DESIGN.md rule 11):
- mcore_to_hf(name, tensor) -> [(hf_name, tensor), ...]   (one fused Megatron tensor may give several)
- hf_sources(name) -> [hf_name, ...] and hf_to_mcore(name, tensors) -> tensor
The same maps feed the converters in tools/, the HF loader and the weight push to rollout engines.

Megatron's fused QKV weight is laid out per query group: that group's query heads, then its key head, then
its value head ([ng * (nh/ng + 2) * d, H]); the SwiGLU fc1 is [gate; up].
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dapo_mcore.config.model_spec import ModelSpec

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class _Rule:
    mcore: str  # template; {i} is the global layer index
    hf: tuple[str, ...]  # templates of the HF tensors it is made of
    merge: Callable[[Tensors], torch.Tensor]
    split: Callable[[torch.Tensor], Tensors]


def _same(tensors: Tensors) -> torch.Tensor:
    return tensors[0]


def _one(tensor: torch.Tensor) -> Tensors:
    return [tensor]


class LlamaFamilyMap:
    """Name and layout map between a Megatron GPTModel and an HF Llama/Qwen2/Qwen3 checkpoint."""

    def __init__(self, spec: ModelSpec, te_layer_names: bool = False):
        self.spec, self.te_layer_names = spec, te_layer_names
        self._rules = self._build_rules(te_layer_names)
        self._patterns = [
            (re.compile("^" + re.escape(r.mcore).replace(r"\{i\}", r"(\d+)") + "$"), r) for r in self._rules
        ]

    def mcore_names(self) -> list[str]:
        """Every Megatron parameter name of the whole model, global layer indices."""
        names = []
        for rule in self._rules:
            if "{i}" in rule.mcore:
                names += [rule.mcore.format(i=i) for i in range(self.spec.num_layers)]
            else:
                names.append(rule.mcore)
        return names

    def hf_sources(self, mcore_name: str) -> list[str]:
        rule, layer = self._match(mcore_name)
        return [t.format(i=layer) for t in rule.hf]

    def hf_to_mcore(self, mcore_name: str, hf_tensors: Tensors) -> torch.Tensor:
        rule, _ = self._match(mcore_name)
        return rule.merge(hf_tensors)

    def mcore_to_hf(self, mcore_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if mcore_name == "output_layer.weight" and self.spec.tie_word_embeddings:
            return []  # the HF model ties lm_head to embed_tokens, which the embedding already carries
        rule, layer = self._match(mcore_name)
        return [(t.format(i=layer), piece) for t, piece in zip(rule.hf, rule.split(tensor))]

    def _match(self, mcore_name: str) -> tuple[_Rule, int | None]:
        for pattern, rule in self._patterns:
            m = pattern.match(mcore_name)
            if m:
                return rule, int(m.group(1)) if m.groups() else None
        raise KeyError(f"no HF mapping for Megatron parameter '{mcore_name}'")

    def _build_rules(self, te: bool) -> list[_Rule]:
        s = self.spec
        hf_layer, mc_layer = "model.layers.{i}.", "decoder.layers.{i}."
        input_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"

        def qkv(kind: str) -> tuple[str, ...]:
            return tuple(hf_layer + f"self_attn.{p}_proj.{kind}" for p in "qkv")

        rules = [
            _Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _same, _one),
            _Rule(mc_layer + input_norm, (hf_layer + "input_layernorm.weight",), _same, _one),
            _Rule(mc_layer + "self_attention.linear_qkv.weight", qkv("weight"), self._merge_qkv, self._split_qkv),
            _Rule(mc_layer + "self_attention.linear_proj.weight", (hf_layer + "self_attn.o_proj.weight",), _same, _one),
            _Rule(mc_layer + mlp_norm, (hf_layer + "post_attention_layernorm.weight",), _same, _one),
            _Rule(
                mc_layer + "mlp.linear_fc1.weight",
                (hf_layer + "mlp.gate_proj.weight", hf_layer + "mlp.up_proj.weight"),
                lambda t: torch.cat(t, dim=0),
                lambda x: list(x.chunk(2, dim=0)),
            ),
            _Rule(mc_layer + "mlp.linear_fc2.weight", (hf_layer + "mlp.down_proj.weight",), _same, _one),
            _Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _same, _one),
            _Rule(
                "output_layer.weight",
                ("model.embed_tokens.weight",) if s.tie_word_embeddings else ("lm_head.weight",),
                _same,
                _one,
            ),
        ]
        if s.qkv_bias:
            rules.append(
                _Rule(mc_layer + "self_attention.linear_qkv.bias", qkv("bias"), self._merge_qkv, self._split_qkv)
            )
        if s.qk_norm:
            rules += [
                _Rule(
                    mc_layer + "self_attention.q_layernorm.weight", (hf_layer + "self_attn.q_norm.weight",), _same, _one
                ),
                _Rule(
                    mc_layer + "self_attention.k_layernorm.weight", (hf_layer + "self_attn.k_norm.weight",), _same, _one
                ),
            ]
        return rules

    def _merge_qkv(self, qkv: Tensors) -> torch.Tensor:
        q, k, v = qkv
        s = self.spec
        per_group = s.num_heads // s.num_kv_heads
        rest = q.shape[1:]  # (H,) for weights, () for biases
        grouped = [
            q.reshape(s.num_kv_heads, per_group * s.head_dim, *rest),
            k.reshape(s.num_kv_heads, s.head_dim, *rest),
            v.reshape(s.num_kv_heads, s.head_dim, *rest),
        ]
        return torch.cat(grouped, dim=1).reshape(-1, *rest)

    def _split_qkv(self, fused: torch.Tensor) -> Tensors:
        s = self.spec
        per_group = s.num_heads // s.num_kv_heads
        rest = fused.shape[1:]
        grouped = fused.reshape(s.num_kv_heads, (per_group + 2) * s.head_dim, *rest)
        q, k, v = grouped.split([per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
