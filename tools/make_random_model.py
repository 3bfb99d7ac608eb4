#!/usr/bin/env python
"""A model directory without weights for runs with model.init=random: a config.json of the size asked and the
char tokenizer, so that every engine can decode what a random model samples. A Llama (about 0.5B parameters
by default; used by tools/gpu_check.sh for the DAPO step on a GPU) or a Qwen3-MoE (--family qwen3_moe).

    python tools/make_random_model.py --out /tmp/llama-0.5b [--hidden 1024 --layers 32 --ffn 4096]
    python tools/make_random_model.py --out /tmp/moe-tiny --family qwen3_moe --hidden 64 --layers 2 \\
        --heads 4 --kv-heads 2 --experts 8 --topk 2 --moe-ffn 32 [--dense-layers 0]
    python tools/bench_step.py examples/smoke_cpu.yaml model.hf_path=/tmp/llama-0.5b model.init=random ...
    dapo-mcore train examples/smoke_cpu.yaml model.hf_path=/tmp/moe-tiny model.init=random
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dapo_mcore.data.tokenizer import build_char_tokenizer, vocab_size


def llama_config(hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, max_len: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def qwen3_moe_config(base: dict, experts: int, topk: int, moe_ffn: int, dense_layers: list[int]) -> dict:
    """Qwen3-MoE's fields as Qwen3-30B-A3B's config.json has them (renormalised top-k, aux loss 0.001)."""
    return {
        **base,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": moe_ffn,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "attention_bias": False,
        "use_sliding_window": False,
    }


def parameter_count(args: argparse.Namespace) -> int:
    head_dim = args.hidden // args.heads
    attention = 2 * args.hidden * args.heads * head_dim + 2 * args.hidden * args.kv_heads * head_dim
    dense_mlp = 3 * args.hidden * args.ffn
    if args.family == "llama":
        mlps = args.layers * dense_mlp
    else:
        sparse = args.layers - len(args.dense_layers)
        moe_mlp = args.experts * 3 * args.hidden * args.moe_ffn + args.experts * args.hidden
        mlps = sparse * moe_mlp + len(args.dense_layers) * dense_mlp
    return args.layers * attention + mlps + 2 * args.hidden * vocab_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", choices=["llama", "qwen3_moe"], default="llama")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=4096, help="the dense MLP's width (dense layers of a MoE)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-ffn", type=int, default=256, help="each expert's MLP width")
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[], help="layers with a dense MLP instead")
    args = ap.parse_args()
    config = llama_config(args.hidden, args.layers, args.ffn, args.heads, args.kv_heads, args.max_len)
    if args.family == "qwen3_moe":
        config = qwen3_moe_config(config, args.experts, args.topk, args.moe_ffn, args.dense_layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    build_char_tokenizer(out)
    kind = "Llama" if args.family == "llama" else f"Qwen3-MoE ({args.experts} experts, top-{args.topk})"
    print(
        f"{out}: {kind}, {parameter_count(args) / 1e6:.1f}M parameters, vocabulary {vocab_size()} "
        "(char tokenizer), no weights"
    )


if __name__ == "__main__":
    main()
