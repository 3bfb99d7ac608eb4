"""Worker: rank 1 reaches the post-generation meeting point later than the default group's timeout allows.

    torchrun --nproc_per_node 2 slow_replica.py OUT_DIR

The default group's timeout is 1 s, the wait group's 1 minute. Phase 1: rank 1 sleeps 2.5 s, then both
all-gather over the wait group (as the sampler does after generating): it must succeed. Phase 2, the control:
the same over the default group must time out on rank 0 (else the test could not fail). Each rank writes
what it saw to OUT_DIR/rank<N>.json.

The default group gets its 1 s only once the groups exist: Megatron creates its groups through the store under
that timeout, and on a loaded machine (the suite beside it) a rank arrived more than 1 s late there.
"""

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed.distributed_c10d import _set_pg_timeout

from dapo_mcore.parallel import all_gather_objects, init_parallel

LATE_S = 2.5


def gather_late(ctx, group) -> str:
    if ctx.rank == 1:
        time.sleep(LATE_S)
    try:
        return "ok: " + ",".join(all_gather_objects(f"r{ctx.rank}", group=group))
    except Exception as err:  # noqa: BLE001 - what the control expects on rank 0
        return f"failed: {type(err).__name__}"


def main() -> None:
    out = Path(sys.argv[1])
    ctx = init_parallel(1, 1, "cpu", timeout_minutes=2, wait_timeout_minutes=1)
    _set_pg_timeout(timedelta(seconds=1))  # the default group's, as parallel.timeout_minutes=1/60 would set it
    seen = {"wait_group": gather_late(ctx, ctx.wait_group)}
    seen["default_group"] = gather_late(ctx, None)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(seen))
    # the default group may be broken by the control's timeout: leave without tearing it down collectively


if __name__ == "__main__":
    main()
