"""Model provider: a Hugging Face config.json -> Megatron-Core TransformerConfig and GPTModel chunks.

The architecture (ModelSpec) is read from config.json by dapo_mcore.config.model_spec, without torch.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from dapo_mcore.config.model_spec import ModelSpec
from dapo_mcore.mcore.mcore_compat import cpu_rope_cp_slice, quiet_notices
from dapo_mcore.utils.errors import ConfigError, LayoutError
from dapo_mcore.utils.install import RECOMMENDED
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_layout(spec: ModelSpec, tp: int, pp: int, vpp: int = 1, ep: int = 1, etp: int = 0) -> None:
    """Refuse a layout the model cannot be split into, before anything is allocated."""
    if not spec.is_moe and (ep > 1 or etp):
        raise LayoutError(
            f"parallel.expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp}: the model "
            f"({spec.model_type}) has no experts; leave them at 1 and 0"
        )
    checks = [
        ("attention heads", spec.num_heads, tp, "tensor_model_parallel_size"),
        ("key/value heads", spec.num_kv_heads, tp, "tensor_model_parallel_size"),
        ("FFN width", spec.ffn_hidden_size, tp, "tensor_model_parallel_size"),
        ("layers", spec.num_layers, pp * vpp, "pipeline_model_parallel_size x virtual_pipeline_model_parallel_size"),
    ]
    if spec.is_moe:
        checks += [
            ("experts", spec.num_experts, ep, "expert_model_parallel_size"),
            ("expert FFN width", spec.moe_ffn_hidden_size, etp or tp, "expert_tensor_parallel_size"),
        ]
    for what, count, size, key in checks:
        if count % size:
            raise LayoutError(f"the model's {count} {what} do not split over parallel.{key}={size}")


def check_moe_training_layout(spec: ModelSpec, tp: int, sequence_parallel: bool) -> None:
    """Megatron-Core's MoE layer refuses to train with TP but without sequence parallelism (a forward alone,
    as the conversion check runs, it allows)."""
    if spec.is_moe and tp > 1 and not sequence_parallel:
        raise ConfigError(
            f"a mixture-of-experts model at parallel.tensor_model_parallel_size={tp} needs "
            "parallel.sequence_parallel=true (Megatron-Core's MoE layer refuses to train TP without it)"
        )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: a multiple of divisible_by * TP (padded logits are masked out)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def build_transformer_config(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    dtype: str,
    on_cpu: bool,
    use_te: bool,
    vpp: int = 1,
    sequence_parallel: bool = False,
    fp8: str = "none",
    fp8_recipe: str = "blockwise",
    fp8_first_last_layers_bf16: bool = False,
    recompute: str = "none",
    recompute_num_layers: int = 1,
    ep: int = 1,
    etp: int = 0,
    moe_aux_loss_coeff: float = -1.0,
    moe_dispatcher: str = "alltoall",
    cp: int = 1,
    cp_comm_type: str = "p2p",
) -> Any:
    """cp: the context-parallel size; cp_comm_type: Transformer Engine's CP exchange at cp > 1 ("p2p" takes bshd
    and THD rows and overlaps its ring with compute; "all_gather" refuses THD: TE's
    AttnFuncWithCPAndKVAllGather asserts qkv_format != "thd"). The local spec's CP attention (mcore/cp_attention.py)
    always all-gathers K and V, whatever this says."""
    from megatron.core.transformer import TransformerConfig

    if on_cpu and cp > 1:
        cpu_rope_cp_slice()  # Megatron's RoPE slicing per CP rank pins host memory, which a CPU-only torch refuses
    if on_cpu and dtype != "float32":
        raise ConfigError(f"model.dtype={dtype} needs a GPU; the CPU mode runs float32 (model.dtype=float32)")
    if spec.is_moe and on_cpu and moe_dispatcher == "alltoall" and (etp or tp) > 1:
        raise ConfigError(
            f"model.moe_token_dispatcher=alltoall with an expert TP of {etp or tp} does not run on the CPU (its "
            "all-gather of uneven token counts is NCCL's alone, gloo refuses it): use "
            "parallel.expert_tensor_parallel_size=1 or model.moe_token_dispatcher=allgather there"
        )
    torch_dtype = _DTYPES[dtype]
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_std,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        cp_comm_type=cp_comm_type if cp > 1 else None,
        sequence_parallel=sequence_parallel,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch_dtype,
        params_dtype=torch_dtype,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        # The fused kernels below come from Transformer Engine / apex; the local path runs plain torch.
        bias_activation_fusion=use_te,
        masked_softmax_fusion=use_te,
        apply_rope_fusion=use_te,
        bias_dropout_fusion=use_te,
        persist_layer_norm=use_te,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
        **_precision_kwargs(fp8, fp8_recipe, fp8_first_last_layers_bf16, use_te),
        **_recompute_kwargs(recompute, recompute_num_layers),
        **_moe_kwargs(spec, ep, etp or tp, moe_aux_loss_coeff, moe_dispatcher, use_te, tp if sequence_parallel else 1),
        # gloo matches point-to-point messages by peer and order; the interleaved (VPP) 1F1B schedule's
        # batched isend/irecv then pairs activations with gradients of the same shape (wrong results from
        # the third micro-batch on, seen with PP=2 x VPP=2). Unbatched p2p keeps a fixed order.
        batch_p2p_comm=not on_cpu,
        perform_initialization=True,
        # DAPO's token-level loss: the schedule sums token counts, finalize_model_grads divides by them.
        calculate_per_token_loss=True,
    )


def _precision_kwargs(fp8: str, recipe: str, first_last_bf16: bool, use_te: bool) -> dict[str, Any]:
    if fp8 == "none":
        return {}
    if not use_te:
        raise ConfigError(f"model.fp8={fp8} needs Transformer Engine layers on a GPU (model.transformer_impl)")
    if recipe == "mxfp8" and torch.cuda.get_device_capability()[0] < 10:
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(
            f"model.fp8_recipe=mxfp8 needs a Blackwell GPU (compute capability 10+), this one is "
            f"{major}.{minor}; use blockwise on Hopper"
        )
    extra = {"num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1} if first_last_bf16 else {}
    return {"fp8": fp8, "fp8_recipe": recipe, "first_last_layers_bf16": first_last_bf16, **extra}


def _moe_kwargs(
    spec: ModelSpec, ep: int, etp: int, aux_loss_coeff: float, dispatcher: str, use_te: bool, sp_ranks: int
) -> dict:
    """Megatron-Core's MoE layer as Qwen3-MoE's sparse block computes it (transformers'
    Qwen3MoeSparseMoeBlock): a bias-free fp32 router, softmax over all experts and the top-k of it; with
    norm_topk_prob the picked weights are renormalised, which is a softmax over the top-k logits alone
    (Megatron's pre_softmax=False), without it they stay the full softmax's (pre_softmax=True). Dropless
    (no capacity factor), no shared expert.

    sp_ranks: the TP ranks a sequence is split over (sequence parallelism). With calculate_per_token_loss,
    Megatron scales each rank's share of the load-balancing loss by that rank's count of non-padding tokens
    (router.attach_and_log_load_balancing_loss), which gives the aux loss's gradient 1/sp_ranks of its
    weight at TP=1 when the ranks hold as many (measured without padding: exactly 0.5 at TP=2); the
    coefficient is multiplied back. With padding the ranks' shares still weigh by their own counts, so the aux
    loss's gradient is not quite the TP=1 one there (docs/moe.md). Context parallelism needs no factor: Megatron
    reduces the expert counts over TP x CP as well, yet the aux loss's gradient at EP 2 x CP 2 came out CP 1's
    without one (measured at coefficient 0.1: ratio 1.000000, gradients within 4e-8, with padded rows too;
    tests/dist/test_moe_parallel.py), so only the SP ranks multiply it."""
    if not spec.is_moe:
        return {}
    coeff = spec.router_aux_loss_coef if aux_loss_coeff < 0 else aux_loss_coeff
    coeff *= sp_ranks
    _megatron_moe_without_te()
    return {
        "num_moe_experts": spec.num_experts,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_router_topk": spec.moe_topk,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not spec.moe_norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none",
        "moe_aux_loss_coeff": coeff,
        "moe_layer_freq": [int(sparse) for sparse in spec.moe_layers],
        "moe_token_dispatcher_type": dispatcher,
        "moe_grouped_gemm": use_te,  # TE's grouped GEMM on a GPU; one MLP per expert in the local spec
        "moe_permute_fusion": use_te,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }


def _megatron_moe_without_te() -> None:
    """Megatron-Core 0.16's router tests `te_general_gemm is not None`, a name it only defines when Transformer
    Engine imports (moe_utils.py): without TE every MoE forward raised NameError. Define it as absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _recompute_kwargs(recompute: str, num_layers: int) -> dict[str, Any]:
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": num_layers}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


def transformer_engine_problem() -> str | None:
    """Why Transformer Engine's PyTorch layers cannot be used in this environment; None when they import."""
    if importlib.util.find_spec("transformer_engine") is None:
        return (
            f"transformer_engine is not installed ({RECOMMENDED.lines()[1]}, docs/gpu.md; or an NGC PyTorch container)"
        )
    try:
        import transformer_engine.pytorch  # noqa: F401  (what Megatron's TE layer spec imports)
    except Exception as err:  # ImportError, or a CUDA library that does not load, raising at import
        cause = (str(err).strip().splitlines() or [""])[0]
        return f"transformer_engine is installed but does not import: {type(err).__name__}: {cause}"
    return None


def cpu_offload_problem(on_cpu: bool) -> str | None:
    """Why optimizer.cpu_offload cannot run here; None when it can. It goes through Megatron's precision-aware
    optimizer, whose config checks Transformer Engine's version: without TE, Megatron-Core 0.16 fails there with
    "'>=' not supported between 'NoneType' and 'Version'" (seen on an H200)."""
    if on_cpu:
        return (
            "optimizer.cpu_offload needs a GPU (Megatron's HybridDeviceOptimizer steps host copies of the GPU's "
            "parameters); on the CPU the optimizer is in host memory already: drop optimizer.cpu_offload"
        )
    problem = transformer_engine_problem()
    if problem is None:
        return None
    return f"optimizer.cpu_offload (Megatron's precision-aware optimizer) needs Transformer Engine: {problem}"


def transformer_engine_available() -> bool:
    return transformer_engine_problem() is None


def resolve_transformer_impl(choice: str, on_cpu: bool, fp8: str = "none") -> bool:
    """True when Transformer Engine layers are used. Where the config needs them (transformer_impl=
    transformer_engine, or FP8), a missing or broken install is one ConfigError naming the cause; with "auto"
    a broken one is a warning, not a silent fall-back to Megatron's local layers."""
    if choice == "local":
        return False
    asked = f"model.transformer_impl={choice}" + (f" with model.fp8={fp8}" if fp8 != "none" else "")
    if on_cpu:
        if choice == "transformer_engine":
            raise ConfigError(f"{asked} needs CUDA: Transformer Engine layers do not run on the CPU")
        return False
    problem = transformer_engine_problem()
    if problem is None:
        return True
    if choice == "transformer_engine" or fp8 != "none":
        raise ConfigError(f"{asked} needs Transformer Engine: {problem}")
    if "does not import" in problem:
        log.warning("model.transformer_impl=auto: %s; using Megatron's local layers instead", problem)
    return False


def _layer_specs(spec: ModelSpec, config: Any, use_te: bool) -> list[Any]:
    """One layer spec per global layer: dense layers, and MoE layers where spec.moe_layers says so. Local layers at
    context parallelism > 1 get the CPU twin of CP attention (Megatron's DotProductAttention refuses CP)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if spec.is_moe:
        layers = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te)
    elif use_te:
        return [get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)] * spec.num_layers
    else:
        layers = [get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm)] * spec.num_layers
    if use_te or config.context_parallel_size == 1:
        return layers
    return _with_cp_attention(layers)


def _with_cp_attention(layers: list[Any]) -> list[Any]:
    """The layer specs with CPAllGatherAttention as core attention: a copy of each distinct spec object (a spec
    shared by several layers stays shared; none that Megatron or another caller holds is changed)."""
    import copy

    from dapo_mcore.mcore.cp_attention import CPAllGatherAttention

    copies: dict[int, Any] = {}
    for layer in layers:
        if id(layer) not in copies:
            mine = copy.deepcopy(layer)
            mine.submodules.self_attention.submodules.core_attention = CPAllGatherAttention
            copies[id(layer)] = mine
    return [copies[id(layer)] for layer in layers]


def _chunk_layer_specs(layer_specs: list[Any], config: Any, ctx: Any, chunk: int) -> list[Any]:
    """The layer specs of one model chunk of this rank (Megatron's own offset for its pipeline stage)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vp_stage = chunk if ctx.vpp_size > 1 else None
    per_chunk = len(layer_specs) // (ctx.pp_size * ctx.vpp_size)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=ctx.pp_rank)
    return layer_specs[offset : offset + per_chunk]


def _local_block(layer_specs: list[Any], sequence_parallel: bool) -> Any:
    """The local spec's block with a local final norm. Given a layer spec alone, Megatron builds the block's
    final norm from Transformer Engine whenever TE imports (its LayerNormImpl), local spec or not: a CPU-mode
    run on a machine with TE installed then failed in that norm (seen on an H100 machine). With sequence
    parallelism, SP-capable norms (Megatron's torch norm refuses sequence parallelism)."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from dapo_mcore.mcore.norms import SequenceParallelRMSNorm, with_sequence_parallel_norms

    if not sequence_parallel:
        return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=LNImpl)
    return TransformerBlockSubmodules(
        layer_specs=[with_sequence_parallel_norms(layer, LNImpl) for layer in layer_specs],
        layer_norm=SequenceParallelRMSNorm,
    )


def _mark_expert_parameters(chunks: list[Any]) -> None:
    """Experts are expert-parallel parameters at every EP size. Megatron-Core 0.16 marks them so
    (`allreduce=False`) only when expert_model_parallel_size > 1; at EP=1 its DDP and optimizer then treat
    them as dense parameters, which (a) reduces their gradients over the dense DP group instead of the
    expert DP group (wrong when the expert TP differs from TP: those ranks share experts but not TP) and (b)
    builds one optimizer where EP > 1 builds two (dense, experts), so a save could not resume at another EP
    (the optimizer's keys differ). Marked here, every layout has the same two optimizers."""
    from dapo_mcore.mcore.sharding import is_expert_param

    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if is_expert_param(name):
                param.allreduce = False


def _te_norm() -> Any:
    from megatron.core.extensions.transformer_engine import TENorm

    return TENorm


def build_gpt_chunks(spec: ModelSpec, config: Any, *, ctx: Any, use_te: bool) -> list[Any]:
    """The model chunks this rank holds: one per virtual pipeline stage (one without VPP)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer_specs = _layer_specs(spec, config, use_te)
    quiet_notices()  # Megatron-Core 0.18+'s lines about GPTModel and DDP that say nothing about the run

    def block(chunk: int) -> Any:
        mine = _chunk_layer_specs(layer_specs, config, ctx, chunk)
        if use_te:
            return TransformerBlockSubmodules(layer_specs=mine, layer_norm=_te_norm())
        return _local_block(mine, config.sequence_parallel)

    chunks = [
        GPTModel(
            config=config,
            transformer_layer_spec=block(chunk),
            vocab_size=padded_vocab_size(spec.vocab_size, ctx.tp_size),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=ctx.chunk_has_embedding(chunk),
            post_process=ctx.chunk_has_head(chunk),
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            rope_scaling=spec.rope_scaling_factor is not None,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
            pg_collection=ctx.pg,
            vp_stage=chunk if ctx.vpp_size > 1 else None,
        )
        for chunk in range(ctx.vpp_size)
    ]
    if spec.is_moe:
        _mark_expert_parameters(chunks)
    if not ctx.is_cpu:
        # What Megatron's own get_model does after building: the local spec's norms (torch.nn.RMSNorm when apex
        # is missing) are made on the host in float32; move every chunk to this rank's GPU and cast it to the
        # params dtype, as Float16Module does (else a bf16 GPU run fails in its first norm, found on an H100).
        for model in chunks:
            model.to(device=ctx.device, dtype=config.params_dtype)
    return chunks
