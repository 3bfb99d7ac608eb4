"""Each task's engine runs on its own GPU: placement from RANK / LOCAL_RANK for 8 tasks on one node and 16 on
two, at engine TP 1, 2, 4, 8, and the vLLM / SGLang arguments carry it (no engine package imported)."""

import pytest

from dapo_mcore.rollout.base import EngineSettings
from dapo_mcore.rollout.placement import engine_placement
from dapo_mcore.rollout.sglang_engine import _engine_kwargs
from dapo_mcore.rollout.vllm_engine import _check_local_rank, _llm_kwargs
from dapo_mcore.utils.errors import LayoutError

GPUS_PER_NODE = 8
LAYOUTS = [pytest.param(1, id="1node-8tasks"), pytest.param(2, id="2nodes-16tasks")]
ENGINE_TP = [1, 2, 4, 8]


def tasks(nodes: int, tp: int, device: str = "cuda"):
    """What torchrun / slurm/train.sbatch give each task: RANK, LOCAL_RANK (node-major, 8 per node)."""
    world = nodes * GPUS_PER_NODE
    return [engine_placement(rank, rank % GPUS_PER_NODE, world, tp, device) for rank in range(world)]


@pytest.mark.parametrize("nodes", LAYOUTS)
@pytest.mark.parametrize("tp", ENGINE_TP)
def test_every_task_engine_runs_on_its_own_gpu_of_its_node(nodes, tp):
    placements = tasks(nodes, tp)
    for node in range(nodes):
        on_node = placements[node * GPUS_PER_NODE : (node + 1) * GPUS_PER_NODE]
        assert [p.device_index for p in on_node] == list(range(GPUS_PER_NODE))  # one engine shard per GPU
    # replicas: tp consecutive ranks each, shards 0..tp-1 in order, all on one node
    assert [p.replica for p in placements] == [r // tp for r in range(nodes * GPUS_PER_NODE)]
    assert {p.n_replicas for p in placements} == {nodes * GPUS_PER_NODE // tp}
    for replica in range(nodes * GPUS_PER_NODE // tp):
        group = [p for p in placements if p.replica == replica]
        assert [p.tp_rank for p in group] == list(range(tp))
        assert len({p.rank // GPUS_PER_NODE for p in group}) == 1


@pytest.mark.parametrize("nodes", LAYOUTS)
@pytest.mark.parametrize("tp", ENGINE_TP)
def test_vllm_uses_the_external_launcher_at_every_engine_tp_on_gpus(nodes, tp, monkeypatch):
    for p in tasks(nodes, tp):
        kwargs = _llm_kwargs(EngineSettings(model_path="m", device=f"cuda:{p.local_rank}", tp_size=tp, placement=p))
        # external_launcher runs the shard on GPU LOCAL_RANK; the default executor would use GPU 0
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        assert kwargs["tensor_parallel_size"] == tp
        # the other TP groups are independent replicas, not one data-parallel engine stepping in lockstep
        assert kwargs.get("data_parallel_size", 1) == 1
        monkeypatch.setenv("LOCAL_RANK", str(p.local_rank))
        _check_local_rank(EngineSettings(model_path="m", placement=p))


def test_vllm_refuses_a_local_rank_that_is_not_the_placement_device(monkeypatch):
    p = tasks(1, 1)[3]
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RuntimeError, match="belongs on cuda:3, but LOCAL_RANK=0"):
        _check_local_rank(EngineSettings(model_path="m", placement=p))


@pytest.mark.parametrize("nodes", LAYOUTS)
def test_sglang_starts_each_task_engine_on_its_local_gpu(nodes):
    for p in tasks(nodes, 1):
        kwargs = _engine_kwargs(EngineSettings(model_path="m", device="cuda", placement=p))
        assert kwargs["base_gpu_id"] == p.local_rank == p.rank % GPUS_PER_NODE


def test_on_the_cpu_engines_keep_the_in_process_defaults(tiny_llama_dir):
    p = engine_placement(1, 1, 2, 1, "cpu")
    assert p.device_index is None
    settings = EngineSettings(model_path=str(tiny_llama_dir), device="cpu", placement=p)
    assert "distributed_executor_backend" not in _llm_kwargs(settings)
    assert "base_gpu_id" not in _engine_kwargs(settings)
    # engine TP > 1 on the CPU: the external launcher as before
    tp2 = engine_placement(1, 1, 2, 2, "cpu")
    kwargs = _llm_kwargs(EngineSettings(model_path="m", device="cpu", tp_size=2, placement=tp2))
    assert kwargs["distributed_executor_backend"] == "external_launcher"


def test_a_standalone_engine_has_no_placement():
    kwargs = _llm_kwargs(EngineSettings(model_path="m", device="cuda"))
    assert "distributed_executor_backend" not in kwargs  # `dapo-mcore eval`: one process, the default GPU
    assert "base_gpu_id" not in _engine_kwargs(EngineSettings(model_path="m", device="cuda"))


def test_an_engine_tp_that_does_not_divide_the_world_is_one_line():
    with pytest.raises(LayoutError, match="rollout.engine_tp_size=3 does not divide the world size 8"):
        engine_placement(0, 0, 8, 3, "cuda")


def test_the_replica_split_deals_items_round_robin_and_puts_the_gathered_shares_back_in_order():
    """The arithmetic the sampler (twice) and the validator wrote out each on their own."""
    from dapo_mcore.rollout.placement import ReplicaSplit

    items = list(range(7))
    ranks = [ReplicaSplit(rank, world_size=6, tp_size=2) for rank in range(6)]  # 3 replicas of 2 TP ranks
    gathered = [split.mine(items) for split in ranks]  # an all-gather over every rank: each TP rank's copy
    assert gathered[0] == gathered[1] == [0, 3, 6] and gathered[4] == [2, 5]
    assert all(split.in_order(split.per_replica(gathered), len(items)) == items for split in ranks)
    assert [(s.replica, s.tp_rank) for s in ranks[2:4]] == [(1, 0), (1, 1)]
