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


def test_a_one_process_world_whose_free_port_was_taken_meanwhile_takes_another(monkeypatch):
    """The port found free was taken by another run before the store listened on it (EADDRINUSE in a suite run):
    the run failed at its start."""
    import torch.distributed as dist

    destroy_parallel()
    for key in WORLD_KEYS:
        monkeypatch.delenv(key, raising=False)
    real, ports = dist.init_process_group, []

    def first_port_taken(*args, **kwargs):
        ports.append(os.environ["MASTER_PORT"])
        if len(ports) == 1:
            raise dist.DistNetworkError("The server socket has failed to listen ... code: -98, name: EADDRINUSE")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", first_port_taken)
    init_parallel(1, 1, "cpu")
    assert len(ports) == 2 and os.environ["MASTER_PORT"] == ports[1]
    destroy_parallel()
    assert not WORLD_KEYS & set(os.environ)
