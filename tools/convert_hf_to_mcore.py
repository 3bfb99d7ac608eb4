#!/usr/bin/env python
"""Convert an HF checkpoint (Llama 3.x, Qwen2/2.5, Qwen3 dense) into a Megatron-Core distributed checkpoint.

    python tools/convert_hf_to_mcore.py HF_DIR OUT_DIR [--dtype bfloat16]

OUT_DIR loads at any TP x PP layout (`model.init=mcore model.mcore_path=OUT_DIR`); it also carries the HF
config and tokenizer files, for tools/convert_mcore_to_hf.py. Runs in one process on the CPU.
"""

import argparse
import sys
import time
from pathlib import Path

from dapo_mcore.utils.errors import DapoError


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
    from dapo_mcore.checkpoint.conversion import hf_to_mcore
    from dapo_mcore.mcore.provider import load_hf_config
    from dapo_mcore.parallel import destroy_parallel

    if args.out_dir.exists():
        print(f"convert_hf_to_mcore: {args.out_dir} exists; not overwriting it", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        dtype = args.dtype or hf_dtype(load_hf_config(str(args.hf_dir)))
        result = hf_to_mcore(args.hf_dir, args.out_dir, dtype)
    except DapoError as err:
        print(f"convert_hf_to_mcore: error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy_parallel()
    print(
        f"wrote {args.out_dir}: {result['parameters']:,} parameters ({dtype}), "
        f"{result['bytes'] / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s"
    )
    return 0


def hf_dtype(config: dict) -> str:
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return dtype.removeprefix("torch.")


if __name__ == "__main__":
    sys.exit(main())
