"""Worker: launch.agreed over two gloo ranks, one scenario after another.

    torchrun --nproc_per_node 2 agreed_checks.py OUT_DIR

Each scenario is a check that fails on some ranks only (or on none); each rank records what `agreed` returned
or raised (class, message, same_on_every_rank, exit code) in OUT_DIR/rank<N>.json.
"""

import json
import sys
from pathlib import Path

from dapo_mcore.launch import agreed
from dapo_mcore.parallel import init_parallel
from dapo_mcore.utils.errors import CheckpointError, ConfigError, DapoError, DataError


def scenarios(rank: int) -> dict:
    class LocalError(DapoError):  # a class the other rank cannot unpickle
        exit_code = 5

    def fail_on(ranks, make):
        def check():
            if rank in ranks:
                raise make()
            return f"ok on {rank}"

        return check

    return {
        "none": fail_on((), None),
        "rank_1_refuses": fail_on((1,), lambda: CheckpointError("the file of replica 1 is missing")),
        "both_refuse_otherwise": fail_on((0, 1), lambda: [ConfigError, DataError][rank](f"rank {rank}'s reason")),
        "rank_1_fails": fail_on((1,), lambda: ValueError("a bug\nover two lines")),
        "a_local_class": fail_on((0,), lambda: LocalError("local")),
    }


def main() -> None:
    out = Path(sys.argv[1])
    ctx = init_parallel(1, 1, "cpu", timeout_minutes=1)
    seen = {}
    for name, check in scenarios(ctx.rank).items():
        try:
            seen[name] = {"returned": agreed(check)}
        except Exception as err:  # noqa: BLE001 - what each rank raised is the record
            seen[name] = {"class": type(err).__name__, "message": str(err),
                          "same_on_every_rank": getattr(err, "same_on_every_rank", None),
                          "exit_code": getattr(err, "exit_code", None)}  # fmt: skip
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
