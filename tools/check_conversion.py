#!/usr/bin/env python
"""Check a converted checkpoint against its HF original: both models on a fixed prompt set, float32, CPU.

    python tools/check_conversion.py HF_DIR CKPT_DIR [--tp 2] [--atol 1e-4]

Prints the largest absolute difference of the logits and of the per-token log-probs (the trainer's fused
log-prob path); exits 1 beyond --atol, 2 on bad input. With --tp N > 1 it starts N processes itself
(torchrun), so the Megatron model runs tensor-parallel.
"""

import argparse
import os
import sys
from pathlib import Path

from dapo_mcore.utils.errors import DapoError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("ckpt_dir", type=Path)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron model")
    ap.add_argument("--atol", type=float, default=1e-4, help="largest allowed absolute difference")
    args = ap.parse_args()
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # start the TP ranks ourselves
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp), *sys.argv]
        os.execv(sys.executable, cmd)
    from dapo_mcore.checkpoint.conversion import check_conversion, default_prompts
    from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
    from dapo_mcore.parallel import destroy_parallel

    try:
        spec = read_model_spec(load_hf_config(str(args.hf_dir)))
        report = check_conversion(args.hf_dir, args.ckpt_dir, args.tp, default_prompts(args.hf_dir, spec.vocab_size))
    except DapoError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"check_conversion: error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy_parallel()
    if report is None:  # not rank 0
        return 0
    verdict = "PASS" if report.passed(args.atol) else "FAIL"
    print(
        f"{verdict} at TP={report.tp} over {report.tokens} tokens: max |logits diff| = {report.logits_max_diff:.3g}, "
        f"max |log-prob diff| = {report.logprobs_max_diff:.3g} (atol {args.atol:g})"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
