#!/usr/bin/env python
"""Convert an HF checkpoint into a Megatron-Core distributed checkpoint.

Families (config.json model_type): llama (Llama 2 and 3.x, with Llama 3 RoPE scaling), qwen2 (Qwen2/2.5),
qwen3 and the mixture-of-experts qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B); others are refused with one line.

    python tools/convert_hf_to_mcore.py HF_DIR OUT_DIR [--dtype bfloat16]

OUT_DIR loads at any TP x PP layout (`model.init=mcore model.mcore_path=OUT_DIR`); it also carries the HF
config and tokenizer files, for tools/convert_mcore_to_hf.py. Runs in one process on the CPU.
"""

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument(
        "--dtype",
        default="",
        choices=["", "float32", "bfloat16", "float16"],
        help="storage dtype (default: config.json's)",
    )
    args = ap.parse_args()
    from dapo_mcore.checkpoint.conversion import hf_to_mcore, run_conversion

    def convert() -> str:
        result = hf_to_mcore(args.hf_dir, args.out_dir, args.dtype)
        return f"{result['parameters']:,} parameters ({result['dtype']}), {result['bytes'] / 2**20:.1f} MiB"

    return run_conversion("convert_hf_to_mcore", args.out_dir, convert)


if __name__ == "__main__":
    sys.exit(main())
