#!/usr/bin/env python
"""Check a converted checkpoint against its HF original: both models on a fixed prompt set, float32, CPU.

    python tools/check_conversion.py HF_DIR CKPT_DIR [--tp 2] [--atol 1e-4]
    python tools/check_conversion.py HF_A CKPT_A HF_B CKPT_B ...      # several pairs in one launch

Prints the largest absolute difference of the logits and of the per-token log-probs (the trainer's fused
log-prob path), one line per pair (named by its checkpoint when there are several); exits 1 when a pair is
beyond --atol, 2 on bad input. With --tp N > 1 it starts N processes itself (torchrun), so the Megatron model
runs tensor-parallel; the pairs share those processes (their start-up is paid once).
"""

import argparse
import os
import sys
from pathlib import Path

from dapo_mcore.utils.errors import DapoError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, metavar="HF_DIR CKPT_DIR", help="an HF original, then its checkpoint")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron model")
    ap.add_argument("--atol", type=float, default=1e-4, help="largest allowed absolute difference")
    args = ap.parse_args()
    if len(args.dirs) % 2:
        ap.error(f"give HF_DIR CKPT_DIR pairs: {len(args.dirs)} folders given")
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # start the TP ranks ourselves
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp), *sys.argv]
        os.execv(sys.executable, cmd)
    from dapo_mcore.parallel import destroy_parallel

    pairs = list(zip(args.dirs[::2], args.dirs[1::2]))
    verdicts = []
    try:
        for hf_dir, ckpt_dir in pairs:
            verdicts.append(check_pair(hf_dir, ckpt_dir, args.tp, args.atol, named=len(pairs) > 1))
            destroy_parallel(keep_world=True)  # the next pair builds its model in the same processes
    except DapoError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"check_conversion: error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy_parallel()
    return 0 if all(verdicts) else 1


def check_pair(hf_dir: Path, ckpt_dir: Path, tp: int, atol: float, named: bool) -> bool:
    """Check one pair; rank 0 prints its line. True when it passes (on the other ranks: always)."""
    from dapo_mcore.checkpoint.conversion import check_conversion, default_prompts
    from dapo_mcore.config.model_spec import load_hf_config, read_model_spec

    spec = read_model_spec(load_hf_config(str(hf_dir)))
    report = check_conversion(hf_dir, ckpt_dir, tp, default_prompts(hf_dir, spec.vocab_size))
    if report is None:  # not rank 0
        return True
    verdict = "PASS" if report.passed(atol) else "FAIL"
    print(
        (f"{ckpt_dir}: " if named else "")
        + f"{verdict} at TP={report.tp} over {report.tokens} tokens: max |logits diff| = "
        f"{report.logits_max_diff:.3g}, max |log-prob diff| = {report.logprobs_max_diff:.3g} (atol {atol:g})"
    )
    return verdict == "PASS"


if __name__ == "__main__":
    sys.exit(main())
