#!/usr/bin/env python
"""Convert a Megatron-Core checkpoint (from convert_hf_to_mcore.py, or a run save step_N/) to HF safetensors.

    python tools/convert_mcore_to_hf.py CKPT_DIR OUT_DIR [--dtype bfloat16] [--no-verify]

OUT_DIR holds sharded safetensors with their index, config.json and the tokenizer files: load it with
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` or serve it with vLLM/SGLang. Runs in one process on the CPU.
"""

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument(
        "--dtype",
        default="",
        choices=["", "float32", "bfloat16", "float16"],
        help="dtype of the exported tensors (default: the checkpoint's)",
    )
    ap.add_argument("--no-verify", action="store_true", help="skip the CRC-32 check of the save's files")
    args = ap.parse_args()
    from dapo_mcore.checkpoint.conversion import mcore_to_hf, run_conversion
    from dapo_mcore.checkpoint.model_checkpoint import verify_complete

    def convert() -> str:
        if not args.no_verify:  # a damaged save (same size, other bytes) is refused, not converted
            verify_complete(args.ckpt_dir, checksums=True)
        result = mcore_to_hf(args.ckpt_dir, args.out_dir, args.dtype)
        return f"{result['bytes'] / 2**20:.1f} MiB of safetensors ({result['dtype']})"

    return run_conversion("convert_mcore_to_hf", args.out_dir, convert)


if __name__ == "__main__":
    sys.exit(main())
