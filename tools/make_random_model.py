#!/usr/bin/env python
"""A model directory without weights for runs with model.init=random: a Llama config.json of the size asked
(about 0.5B parameters by default) and the char tokenizer, so that every engine can decode what a random
model samples. Used by tools/gpu_check.sh for the DAPO step on a GPU.

    python tools/make_random_model.py --out /tmp/llama-0.5b [--hidden 1024 --layers 32 --ffn 4096]
    python tools/bench_step.py examples/smoke_cpu.yaml model.hf_path=/tmp/llama-0.5b model.init=random ...
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=4096)
    args = ap.parse_args()
    config = llama_config(args.hidden, args.layers, args.ffn, args.heads, args.kv_heads, args.max_len)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    build_char_tokenizer(out)
    per_layer = 2 * args.hidden**2 + 2 * args.hidden * args.kv_heads * (args.hidden // args.heads)
    params = args.layers * (per_layer + 3 * args.hidden * args.ffn) + 2 * args.hidden * vocab_size()
    print(f"{out}: Llama, {params / 1e6:.0f}M parameters, vocabulary {vocab_size()} (char tokenizer), no weights")


if __name__ == "__main__":
    main()
