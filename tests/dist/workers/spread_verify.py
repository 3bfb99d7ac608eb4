"""Worker: two ranks verify a save together, each reading its share of the files.

    torchrun --nproc_per_node 2 spread_verify.py ROOT OUT_DIR

ROOT holds step_000001 (intact) and step_000002, whose file in rank 1's share is damaged (same size). Each rank
writes OUT_DIR/rank<N>.json: the files it checksummed, the error `verified(step_000002)` raised on it, and
what `latest_complete()` returned.
"""

import json
import sys
from pathlib import Path

import dapo_mcore.checkpoint.model_checkpoint as model_checkpoint
from dapo_mcore.checkpoint.run_checkpoint import CheckpointManager
from dapo_mcore.parallel import init_parallel
from dapo_mcore.utils.errors import CheckpointError


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    read = []
    real_crc32 = model_checkpoint.file_crc32
    model_checkpoint.file_crc32 = lambda path: read.append(f"{path.parent.name}/{path.name}") or real_crc32(path)
    ctx = init_parallel(1, 1, "cpu")
    manager = CheckpointManager(root, ctx)
    try:
        manager.verified(root / "step_000002")
        error = None
    except CheckpointError as err:
        error = str(err)
    read_by_verified = list(read)  # latest_complete() reads again below
    latest = manager.latest_complete()
    (out / f"rank{ctx.rank}.json").write_text(
        json.dumps({"read": read_by_verified, "read_all": read, "error": error, "latest": latest.name})
    )


if __name__ == "__main__":
    main()
