"""HF <-> Megatron-Core name maps for Llama-style decoders (llama, qwen2, qwen3) and Qwen3-MoE.

Pure per-parameter maps on full (unsharded) tensors, each rule with its inverse (DESIGN.md rule 11):
- mcore_to_hf(name, tensor) -> [(hf_name, tensor), ...]   (one fused Megatron tensor may give several)
- hf_sources(name) -> [hf_name, ...] and hf_to_mcore(name, tensors) -> tensor
The same maps feed the converters in tools/, the HF loader and the weight push to rollout engines.

Megatron's fused QKV weight is laid out per query group: that group's query heads, then its key head, then
its value head ([ng * (nh/ng + 2) * d, H]); the SwiGLU fc1 is [gate; up], an expert's as well. Expert
names carry the global expert index {e} (mcore/sharding.py makes local indices global).
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
    mcore: str  # template; {i} is the global layer index, {e} the global expert index
    hf: tuple[str, ...]  # templates of the HF tensors it is made of
    merge: Callable[[Tensors], torch.Tensor]
    split: Callable[[torch.Tensor], Tensors]
    layers: str = "all"  # "all", or only the "dense" or the "moe" (sparse) layers


def _regex(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + escaped + "$")


def _cat_rows(tensors: Tensors) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _halves(tensor: torch.Tensor) -> Tensors:
    return list(tensor.chunk(2, dim=0))


def _same(tensors: Tensors) -> torch.Tensor:
    return tensors[0]


def _one(tensor: torch.Tensor) -> Tensors:
    return [tensor]


class LlamaFamilyMap:
    """Name and layout map between a Megatron GPTModel and an HF Llama/Qwen2/Qwen3 checkpoint."""

    def __init__(self, spec: ModelSpec, te_layer_names: bool = False):
        self.spec, self.te_layer_names = spec, te_layer_names
        self._rules = self._build_rules(te_layer_names)
        self._patterns = [(_regex(r.mcore), r) for r in self._rules]
        # each rule's layers, once: the weight export looks up every tensor's name on every push (12k expert
        # tensors at 30B-A3B), and rebuilding the list per lookup cost O(layers) each time
        self._layers = {kind: self._layers_of(kind) for kind in ("all", "dense", "moe")}

    def mcore_names(self) -> list[str]:
        """Every Megatron parameter name of the whole model, global layer and expert indices."""
        names = []
        for rule in self._rules:
            if "{i}" not in rule.mcore:
                names.append(rule.mcore)
                continue
            for i in sorted(self._layers[rule.layers]):
                experts = range(self.spec.num_experts) if "{e}" in rule.mcore else [0]
                names += [rule.mcore.format(i=i, e=e) for e in experts]
        return names

    def hf_sources(self, mcore_name: str) -> list[str]:
        rule, index = self._match(mcore_name)
        return [t.format(**index) for t in rule.hf]

    def hf_to_mcore(self, mcore_name: str, hf_tensors: Tensors) -> torch.Tensor:
        rule, _ = self._match(mcore_name)
        return rule.merge(hf_tensors)

    def mcore_to_hf(self, mcore_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if mcore_name == "output_layer.weight" and self.spec.tie_word_embeddings:
            return []  # the HF model ties lm_head to embed_tokens, which the embedding already carries
        rule, index = self._match(mcore_name)
        return [(t.format(**index), piece) for t, piece in zip(rule.hf, rule.split(tensor))]

    def _layers_of(self, kind: str) -> frozenset[int]:
        """The global layer indices a rule of `kind` ("all", "dense", "moe") covers."""
        layers = range(self.spec.num_layers)
        if kind == "all":
            return frozenset(layers)
        sparse = self.spec.moe_layers or (False,) * self.spec.num_layers
        return frozenset(i for i in layers if sparse[i] == (kind == "moe"))

    def _match(self, mcore_name: str) -> tuple[_Rule, dict[str, int]]:
        for pattern, rule in self._patterns:
            m = pattern.match(mcore_name)
            if m and (m.groupdict().get("i") is None or int(m.group("i")) in self._layers[rule.layers]):
                return rule, {k: int(v) for k, v in m.groupdict().items()}
        raise KeyError(f"no HF mapping for Megatron parameter '{mcore_name}'")

    def _build_rules(self, te: bool) -> list[_Rule]:
        s = self.spec
        hf_layer, mc_layer = "model.layers.{i}.", "decoder.layers.{i}."
        input_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        # TE fuses the norm into a dense layer's fc1; a sparse layer keeps its own norm before the router
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"

        def qkv(kind: str) -> tuple[str, ...]:
            return tuple(hf_layer + f"self_attn.{p}_proj.{kind}" for p in "qkv")

        rules = [
            _Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _same, _one),
            _Rule(mc_layer + input_norm, (hf_layer + "input_layernorm.weight",), _same, _one),
            _Rule(mc_layer + "self_attention.linear_qkv.weight", qkv("weight"), self._merge_qkv, self._split_qkv),
            _Rule(mc_layer + "self_attention.linear_proj.weight", (hf_layer + "self_attn.o_proj.weight",), _same, _one),
            _Rule(mc_layer + mlp_norm, (hf_layer + "post_attention_layernorm.weight",), _same, _one, "dense"),
            _Rule(
                mc_layer + "mlp.linear_fc1.weight",
                (hf_layer + "mlp.gate_proj.weight", hf_layer + "mlp.up_proj.weight"),
                _cat_rows,
                _halves,
                "dense",
            ),
            _Rule(mc_layer + "mlp.linear_fc2.weight", (hf_layer + "mlp.down_proj.weight",), _same, _one, "dense"),
            _Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _same, _one),
            _Rule(
                "output_layer.weight",
                ("model.embed_tokens.weight",) if s.tie_word_embeddings else ("lm_head.weight",),
                _same,
                _one,
            ),
        ]
        if s.is_moe:
            rules += self._moe_rules(te)
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

    @staticmethod
    def _moe_rules(te: bool) -> list[_Rule]:
        """A sparse layer: its norm, the router (HF `gate`) and each expert's SwiGLU MLP. TE's grouped GEMM
        names expert e's weights `linear_fc1.weight<e>`, the local spec `local_experts.<e>.linear_fc1.weight`."""
        hf, mc = "model.layers.{i}.mlp.", "decoder.layers.{i}."
        fc1, fc2 = (
            ("mlp.experts.linear_fc1.weight{e}", "mlp.experts.linear_fc2.weight{e}")
            if te
            else ("mlp.experts.local_experts.{e}.linear_fc1.weight", "mlp.experts.local_experts.{e}.linear_fc2.weight")
        )
        expert = hf + "experts.{e}."
        return [
            _Rule(
                mc + "pre_mlp_layernorm.weight",
                ("model.layers.{i}.post_attention_layernorm.weight",),
                _same,
                _one,
                "moe",
            ),
            _Rule(mc + "mlp.router.weight", (hf + "gate.weight",), _same, _one, "moe"),
            _Rule(mc + fc1, (expert + "gate_proj.weight", expert + "up_proj.weight"), _cat_rows, _halves, "moe"),
            _Rule(mc + fc2, (expert + "down_proj.weight",), _same, _one, "moe"),
        ]

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
