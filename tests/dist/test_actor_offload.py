"""rollout.offload_actor: while the engine generates, the actor's optimizer (Adam moments and the fp32 main
params a bf16 model's distributed optimizer keeps) lives in host memory, and comes back bit for bit.

On the CPU the host is the device, so the worker checks what the move does there too: every optimizer tensor
is replaced by a new one (the old ones are released), the model's own weights stay in place, and the next
update equals that of an actor that was never offloaded, bit for bit.
"""

from pathlib import Path

import torch

from tests.conftest import run_torchrun
from tests.helpers import save_tiny_model

WORKER = Path(__file__).parent / "workers" / "actor_offload.py"


def test_offload_moves_adam_state_and_main_params_to_host_and_restores_them_bit_for_bit(tmp_path):
    hf_dir = save_tiny_model(tmp_path / "hf", "llama", layers=1)
    run_torchrun(WORKER, 1, str(hf_dir), str(tmp_path / "out.pt"))
    r = torch.load(tmp_path / "out.pt")
    assert r["n_state"] > 0 and r["n_main_params"] > 0
    assert all(r["state_released"]), "Adam state left where it was"
    moved = r["main_params_moved"]  # (moved, a view of the model's own weights) per optimizer param
    assert any(not views_model for _, views_model in moved), "no fp32 main param of a bf16 weight"
    assert all(was_moved != views_model for was_moved, views_model in moved), "fp32 main params left in place"
    assert r["same_objects"] and r["model_params_kept"]
    assert all(r["host_copy_equal"]) and all(r["restored_equal"])
    offload, plain = r["weights"]["offload"], r["weights"]["plain"]
    assert set(offload) == set(plain)
    for name, weight in plain.items():
        assert torch.equal(offload[name], weight), name
