"""A one-process world set up in this process (a conversion, an eval) leaves no RANK / MASTER_PORT behind: every
training run started from this process afterwards would otherwise inherit that world and its port."""

import os

from dapo_mcore.parallel import destroy_parallel, init_parallel

WORLD_KEYS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def test_a_one_process_world_takes_its_environment_back(monkeypatch):
    destroy_parallel()
    for key in WORLD_KEYS:
        monkeypatch.delenv(key, raising=False)
    init_parallel(1, 1, "cpu")
    assert os.environ["WORLD_SIZE"] == "1" and "MASTER_PORT" in os.environ
    destroy_parallel()
    assert not WORLD_KEYS & set(os.environ)
