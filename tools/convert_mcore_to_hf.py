#!/usr/bin/env python
"""Convert a Megatron-Core checkpoint (from convert_hf_to_mcore.py, or a run save step_N/) to HF safetensors.

    python tools/convert_mcore_to_hf.py CKPT_DIR OUT_DIR [--dtype bfloat16]

OUT_DIR holds sharded safetensors with their index, config.json and the tokenizer files: load it with
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` or serve it with vLLM/SGLang. Runs in one process on the CPU.
"""

import argparse
import sys
import time
from pathlib import Path

from dapo_mcore.utils.errors import DapoError


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
    args = ap.parse_args()
    from dapo_mcore.checkpoint.conversion import mcore_to_hf
    from dapo_mcore.parallel import destroy_parallel

    if args.out_dir.exists():
        print(f"convert_mcore_to_hf: {args.out_dir} exists; not overwriting it", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        result = mcore_to_hf(args.ckpt_dir, args.out_dir, args.dtype)
    except DapoError as err:
        print(f"convert_mcore_to_hf: error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy_parallel()
    print(
        f"wrote {args.out_dir}: {result['bytes'] / 2**20:.1f} MiB of safetensors ({result['dtype']}) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
