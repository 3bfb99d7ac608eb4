"""Resume verification spread over ranks: each rank checksums its share of a save's files (no rank reads the
whole save while the others wait), and a file damaged in one rank's share stops every rank with its name."""

import json
from pathlib import Path

from dapo_mcore.checkpoint.model_checkpoint import checksum_share, read_manifest, write_manifest
from tests.conftest import run_torchrun

FILES = {"metadata.json": 40, ".metadata": 300, "common.pt": 900, "__0_0.distcp": 5000, "__1_0.distcp": 4800}


def fake_save(path: Path) -> None:
    path.mkdir(parents=True)
    for name, size in FILES.items():
        (path / name).write_bytes(bytes(i % 251 for i in range(size)))
    write_manifest(path)


def test_each_rank_reads_its_share_and_every_rank_names_the_damaged_file(tmp_path):
    root, out = tmp_path / "checkpoints", tmp_path / "out"
    out.mkdir()
    fake_save(root / "step_000001")
    fake_save(root / "step_000002")
    damaged = checksum_share(read_manifest(root / "step_000002"), rank=1, world_size=2)[0]
    data = bytearray((root / "step_000002" / damaged).read_bytes())
    data[7] ^= 0xFF  # same size: only the checksum sees it
    (root / "step_000002" / damaged).write_bytes(bytes(data))
    run_torchrun(Path(__file__).parent / "workers" / "spread_verify.py", 2, str(root), str(out), timeout=120)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in ranks:
        assert seen["error"] and f"{damaged} fails its CRC-32 check" in seen["error"]
        assert seen["latest"] == "step_000001"  # resume=auto falls back past the damaged save on every rank
    damaged_save = [seen["read"] for seen in ranks]
    assert f"step_000002/{damaged}" in damaged_save[1] and f"step_000002/{damaged}" not in damaged_save[0]
    intact = [[name for name in seen["read_all"] if name.startswith("step_000001")] for seen in ranks]
    assert set(intact[0]).isdisjoint(intact[1]) and all(intact)  # both ranks read, neither all of it
    assert sorted(intact[0] + intact[1]) == sorted(f"step_000001/{n}" for n in FILES)
