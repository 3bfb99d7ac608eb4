"""Worker: Megatron's context-parallel groups as init_parallel builds them, at two layouts of one world.

    torchrun --nproc_per_node 4 cp_groups.py OUT_DIR

Layout A is TP 2 x CP 2 (DP 1), layout B TP 1 x CP 2 x DP 2 (the same processes: destroy_parallel(keep_world=True)
between them). Each rank writes, per layout, its ranks and sizes and the global ranks of its groups to
OUT_DIR/rank<N>.json.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from dapo_mcore.checkpoint.run_checkpoint import layout_of
from dapo_mcore.parallel import destroy_parallel, init_parallel

LAYOUTS = {"tp2_cp2": {"tp": 2, "cp": 2}, "tp1_cp2_dp2": {"tp": 1, "cp": 2}}


def seen(ctx) -> dict:
    groups = {name: list(dist.get_process_group_ranks(getattr(ctx.pg, name))) for name in ("tp", "cp", "dp", "dp_cp")}
    return {
        "ranks": {"tp": ctx.tp_rank, "cp": ctx.cp_rank, "dp": ctx.dp_rank},
        "sizes": {"cp": ctx.cp_size, "dp": ctx.dp_size, "dp_cp": ctx.pg.dp_cp.size()},
        "groups": groups,
        "describe": ctx.describe(),
        "layout": layout_of(ctx),
    }


def main() -> None:
    out = Path(sys.argv[1])
    record = {}
    for name, layout in LAYOUTS.items():
        ctx = init_parallel(layout["tp"], 1, "cpu", cp=layout["cp"], peer_timeout_s=0)
        record[name] = seen(ctx)
        destroy_parallel(keep_world=name != list(LAYOUTS)[-1])
        rank = ctx.rank
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
