"""The memory planner (dapo_mcore/plan.py): its parameter counts are those of the Megatron model the provider
builds, its lines move the way the layout says they must, and a layout that does not fit says what to change."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_mcore.config import load_config
from dapo_mcore.config.model_spec import read_model_spec
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config
from dapo_mcore.parallel import destroy_parallel, init_parallel
from dapo_mcore.plan import GIB, ModelShape, plan_command, plan_memory, stage_params
from dapo_mcore.utils.errors import ConfigError
from tests.helpers import tiny_hf_config

REPO = Path(__file__).resolve().parents[2]
QWEN_7B = REPO / "examples/models/Qwen2.5-7B"
HEAVY = ("torch", "megatron", "transformer_engine", "vllm", "sglang")


def hf_dict(family: str, tie: bool = False, layers: int = 4) -> dict:
    return tiny_hf_config(family, tie, layers).to_dict()


def qwen_7b() -> dict:
    return json.loads((QWEN_7B / "config.json").read_text())


def config(*overrides: str):
    return load_config(None, ["rollout.engine=vllm", "data.max_prompt_len=2048", *overrides])


class FakeGroup:
    """A process group of `size` ranks seen from `rank`: what Megatron's layers read while they are built."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture(scope="module")
def one_process_world():
    destroy_parallel()
    ctx = init_parallel(1, 1, "cpu")
    yield ctx
    destroy_parallel()


def megatron_params(ctx, hf: dict, tp: int, pp: int, tp_rank: int, pp_rank: int) -> int:
    """Parameters of the GPTModel the provider builds for one (TP, PP) rank, its layers sized by the groups."""
    pg = copy.copy(ctx.pg)
    pg.tp, pg.pp = FakeGroup(tp, tp_rank), FakeGroup(pp, pp_rank)
    rank_ctx = dataclasses.replace(ctx, tp_size=tp, tp_rank=tp_rank, pp_size=pp, pp_rank=pp_rank, pg=pg)
    spec = read_model_spec(hf)
    experts = {"etp": 1} if spec.is_moe else {}  # the one-process world's expert TP group has one rank
    tconfig = build_transformer_config(spec, tp=tp, pp=pp, dtype="float32", on_cpu=True, use_te=False, **experts)
    chunks = build_gpt_chunks(spec, tconfig, ctx=rank_ctx, use_te=False)
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


@pytest.mark.parametrize(
    "family,tie,tp,pp",
    [
        ("llama", False, 1, 1),
        ("llama", False, 2, 1),
        ("qwen2", False, 1, 1),
        ("qwen2", False, 2, 1),
        ("qwen3", False, 2, 1),
        ("llama", True, 2, 1),
        ("llama", True, 1, 2),  # tied embeddings: the last stage keeps its own output layer
        ("qwen2", False, 2, 2),
        ("qwen3_moe", False, 1, 1),  # layer 0 sparse (4 experts), layer 1 dense
        ("qwen3_moe", False, 2, 1),  # attention over TP 2, experts whole (expert TP 1)
        ("qwen3_moe", False, 1, 2),  # a sparse stage and a dense one
    ],
)
def test_per_rank_parameters_equal_the_megatron_model_the_provider_builds(one_process_world, family, tie, tp, pp):
    hf = hf_dict(family, tie)
    cfg = config(f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}")
    if family == "qwen3_moe":  # the one-process world's expert TP group has one rank
        cfg.parallel.expert_tensor_parallel_size = 1
    for pp_rank in range(pp):
        built = {megatron_params(one_process_world, hf, tp, pp, tp_rank, pp_rank) for tp_rank in range(tp)}
        assert built == {stage_params(cfg, hf, pp_rank, gpus=tp * pp)}, (family, tie, tp, pp, pp_rank)


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_the_planner_sizes_the_model_the_provider_reads(family):
    for hf in (hf_dict(family), hf_dict(family, tie=True), qwen_7b()):
        shape, spec = ModelShape.from_hf(hf), read_model_spec(hf)
        assert (shape.vocab, shape.hidden, shape.layers, shape.ffn, shape.tied) == (
            spec.vocab_size,
            spec.hidden_size,
            spec.num_layers,
            spec.ffn_hidden_size,
            spec.tie_word_embeddings,
        )
        assert (shape.heads, shape.kv_heads, shape.head_dim) == (spec.num_heads, spec.num_kv_heads, spec.head_dim)
        assert (shape.qkv_bias, shape.qk_norm, shape.max_positions) == (
            spec.qkv_bias,
            spec.qk_norm,
            spec.max_position_embeddings,
        )


def test_the_unsharded_count_is_the_hf_models():
    from transformers import AutoModelForCausalLM

    for family, tie in (("llama", False), ("qwen2", False), ("qwen3", True), ("qwen3_moe", False)):
        model = AutoModelForCausalLM.from_config(tiny_hf_config(family, tie, 3))
        assert ModelShape.from_hf(hf_dict(family, tie, 3)).total_params() == sum(p.numel() for p in model.parameters())


def test_the_optimizer_line_halves_when_dp_doubles_with_the_distributed_optimizer():
    cfg = config("parallel.tensor_model_parallel_size=2")
    train8, train16 = (plan_memory(cfg, qwen_7b(), 80, gpus=n).phase("train") for n in (8, 16))
    for line in ("actor fp32 master", "actor Adam moments"):
        assert train16.bytes_of(line) == pytest.approx(train8.bytes_of(line) / 2)
        assert train8.bytes_of(line) > 0
    for line in ("actor weights", "actor gradients"):  # neither is sharded over DP
        assert train16.bytes_of(line) == train8.bytes_of(line)
    replicated = config("parallel.tensor_model_parallel_size=2", "parallel.use_distributed_optimizer=false")
    moments = [
        plan_memory(replicated, qwen_7b(), 80, gpus=n).phase("train").bytes_of("actor Adam moments") for n in (8, 16)
    ]
    assert moments[0] == moments[1] == pytest.approx(train8.bytes_of("actor Adam moments") * 4)


def test_optimizer_bytes_per_parameter_follow_the_dtype_and_cpu_offload():
    hf = qwen_7b()
    for dtype, master in (("bfloat16", 4), ("float32", 0)):
        cfg = config(f"model.dtype={dtype}", "parallel.use_distributed_optimizer=false")
        train, params = plan_memory(cfg, hf, 1000, gpus=1).phase("train"), stage_params(cfg, hf, gpus=1)
        assert train.bytes_of("actor fp32 master") == pytest.approx(master * params)
        assert train.bytes_of("actor Adam moments") == pytest.approx(8 * params)
        assert train.bytes_of("actor gradients") == pytest.approx(4 * params)  # fp32 main grads either way
    offloaded = config("optimizer.cpu_offload=true", "optimizer.offload_fraction=0.75")
    full = plan_memory(config(), hf, 1000, gpus=8).phase("train").bytes_of("actor Adam moments")
    assert plan_memory(offloaded, hf, 1000, gpus=8).phase("train").bytes_of("actor Adam moments") == pytest.approx(
        full / 4
    )


def test_cpu_offload_keeps_no_master_copy_on_the_gpu_and_plans_the_host_memory():
    """optimizer.cpu_offload through Megatron's precision-aware path: the GPU keeps only (1 - fraction) of the
    fp32 master and moments (also while generating, where rollout.offload_actor does not move them), the host
    the rest and pinned fp32 gradients for them; the actor asks Megatron for that path."""
    from dapo_mcore.mcore.actor import OptimizerSettings, megatron_optimizer_options

    hf = qwen_7b()
    cfg = config("optimizer.cpu_offload=true", "optimizer.offload_fraction=0.75", "rollout.offload_actor=true")
    plan = plan_memory(cfg, hf, 1000, gpus=8)
    shard = stage_params(cfg, hf, gpus=8) / 8  # TP 1, DP 8
    for phase in ("generate", "train"):
        assert plan.phase(phase).bytes_of("actor fp32 master") == pytest.approx(4 * shard * 0.25)
        assert plan.phase(phase).bytes_of("actor Adam moments") == pytest.approx(8 * shard * 0.25)
    host = {line.name: line.bytes for line in plan.host_lines}
    assert host == pytest.approx(
        {"fp32 master (host)": 3 * shard, "Adam moments (host)": 6 * shard, "fp32 gradients, pinned (host)": 3 * shard}
    )
    assert plan_memory(config(), hf, 1000, gpus=8).host_lines == ()
    options = megatron_optimizer_options(
        OptimizerSettings(1e-6, 0, 0, 1, 0.1, 1.0, 0.9, 0.999, 1e-8, True, cpu_offload=True, offload_fraction=0.75),
        dataclasses.make_dataclass("C", ["bf16", "fp16", "params_dtype"])(True, False, torch.bfloat16),
    )
    assert options["use_precision_aware_optimizer"] and options["optimizer_cpu_offload"]
    assert options["optimizer_offload_fraction"] == 0.75


def test_the_step_batch_is_the_ranks_share_of_the_step_with_its_routing_under_replay():
    """The old log-probs and the update read the step's micro-batches from the device: this rank's 1/DP share
    of the step's answers at full length, 48 B a token, + layers x top-k bytes a token with routing replay."""
    step = ["rollout.prompts_per_step=64", "rollout.gen_prompts_per_round=64", "rollout.n_samples_per_prompt=8"]
    line, sequence = "step batch (micro-batch tensors)", 2048 + 20480
    plan = plan_memory(config(*step), qwen_7b(), 1000, gpus=8)
    assert plan.phase("train").bytes_of(line) == 64 * 8 / 8 * sequence * 48
    assert plan.phase("weight push").bytes_of(line) == 0  # released before it
    moe = json.loads((REPO / "examples/models/Qwen3-30B-A3B/config.json").read_text())  # 48 layers, top-8
    off = plan_memory(config(*step), moe, 1000, gpus=8).phase("train").bytes_of(line)
    on = plan_memory(config(*step, "model.routing_replay=rollout"), moe, 1000, gpus=8).phase("train").bytes_of(line)
    assert on == pytest.approx(off / 48 * (48 + 48 * 8))


def test_recompute_full_shrinks_activations_and_selective_drops_only_unfused_attention_scores():
    hf = qwen_7b()
    gpu = {
        mode: plan_memory(config(f"model.recompute={mode}"), hf, 1000, gpus=8)
        .phase("train")
        .bytes_of("actor activations")
        for mode in ("none", "selective", "full")
    }
    assert 0 < gpu["full"] < gpu["none"] / 10
    assert gpu["selective"] == gpu["none"]  # flash attention keeps no scores to drop
    cpu = {
        mode: plan_memory(
            config(f"model.recompute={mode}", "parallel.device=cpu", "model.dtype=float32"), hf, 1000, gpus=8
        )
        .phase("train")
        .bytes_of("actor activations")
        for mode in ("none", "selective")
    }
    row = 2048 + 20480
    tokens = 4 * row  # trainer.micro_batch_size rows of the longest sequence
    scores = 4 * 28 * row  # fp32 softmax output: heads x row per token
    assert cpu["none"] - cpu["selective"] == pytest.approx(28 * scores * tokens)  # 28 layers


def test_the_interleaved_schedule_holds_narayanans_factor_more_on_the_first_stage():
    hf, p, v = qwen_7b(), 4, 7  # 28 layers = 4 stages x 7 chunks of one layer
    base = ["parallel.pipeline_model_parallel_size=4", "trainer.micro_batch_size=1"]
    plans = [
        plan_memory(config(*base, f"parallel.virtual_pipeline_model_parallel_size={vpp}"), hf, 1000, gpus=4)
        for vpp in (1, v)
    ]
    assert [plan.stage for plan in plans] == ["first stage", "first stage"]
    plain, interleaved = (plan.phase("train").bytes_of("actor activations") for plan in plans)
    assert interleaved / plain == pytest.approx(1 + (p - 1) / (p * v))
    one_stage = plan_memory(config("trainer.micro_batch_size=1"), hf, 1000, gpus=4).phase("train")
    assert plain == pytest.approx(one_stage.bytes_of("actor activations"))  # p micro-batches of L / p layers


def test_local_layer_activations_match_what_autograd_saves(one_process_world):
    """The CPU formula against the tensors autograd keeps: one layer is the difference of 3- and 1-layer models."""
    b, s = 2, 256
    hf = {
        **hf_dict("llama", layers=1),
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 640,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    }

    def saved_bytes(layers: int) -> int:
        spec = read_model_spec({**hf, "num_hidden_layers": layers})
        tconfig = build_transformer_config(spec, tp=1, pp=1, dtype="float32", on_cpu=True, use_te=False)
        model = build_gpt_chunks(spec, tconfig, ctx=one_process_world, use_te=False)[0]
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, 1000, (b, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, torch.arange(s).expand(b, s), None)
        return sum(seen.values())

    measured = (saved_bytes(3) - saved_bytes(1)) / 2 / (b * s)
    cfg = config(
        "parallel.device=cpu",
        "model.dtype=float32",
        "data.max_prompt_len=56",
        "rollout.sampling.max_response_len=200",
        "trainer.micro_batch_size=2",
    )
    train = plan_memory(cfg, {**hf, "num_hidden_layers": 1}, 1000, gpus=1).phase("train")
    planned = train.bytes_of("actor activations") / (b * s)
    assert planned == pytest.approx(measured, rel=0.03)


def test_the_engine_kv_cache_grows_by_the_memory_it_is_given():
    hf = qwen_7b()
    kv = [plan_memory(config(f"rollout.gpu_memory_utilization={u}"), hf, 80, gpus=8).kv for u in (0.5, 0.6)]
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16, engine TP 1
    assert (kv[1].tokens - kv[0].tokens) * per_token == pytest.approx(0.1 * 80 * GIB)
    assert kv[0].wanted == pytest.approx(1536 / 8 * 16 * (2048 + 20480))


def test_a_layout_that_does_not_fit_returns_1_and_says_what_to_change(capsys):
    code = plan_command(
        str(REPO / "examples/dapo_qwen2.5_7b_h100.yaml"),
        ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false", "model.recompute=none"],
        80,
        str(QWEN_7B),
        gpus=8,
    )
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out
    assert "model.recompute=full" in out and "parallel.tensor_model_parallel_size=2" in out
    suggestions = out.split("what would help")[1].strip().splitlines()[1:]
    assert suggestions and all("GiB" in line for line in suggestions)


def test_a_layout_that_fits_returns_0(capsys):
    code = plan_command(str(REPO / "examples/dapo_qwen2.5_7b_h100.yaml"), [], 80, str(QWEN_7B / "config.json"), 8)
    assert code == 0 and "fits: peak" in capsys.readouterr().out


def test_a_missing_config_json_is_a_config_error_naming_the_path(tmp_path):
    recipe = str(REPO / "examples/dapo_qwen2.5_7b_h100.yaml")
    with pytest.raises(ConfigError, match=re.escape(f"no config.json at {tmp_path / 'config.json'} (--model-config)")):
        plan_command(recipe, [], 80, str(tmp_path))
    nowhere = tmp_path / "Qwen2.5-7B"
    with pytest.raises(ConfigError, match=re.escape(f"no config.json at {nowhere / 'config.json'} (model.hf_path)")):
        plan_command(recipe, [f"model.hf_path={nowhere}"], 80, None)


def test_planning_imports_no_torch_and_no_engine():
    code = f"import sys, dapo_mcore.plan; print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_a_config_json_the_provider_refuses_is_refused_by_the_planner_with_the_same_line():
    hf = {**qwen_7b(), "use_sliding_window": True}
    with pytest.raises(ConfigError, match="use_sliding_window=true is not supported"):
        ModelShape.from_hf(hf)
    no_heads = {k: v for k, v in qwen_7b().items() if k != "num_attention_heads"}
    with pytest.raises(ConfigError, match="config.json has no 'num_attention_heads'"):
        read_model_spec(no_heads)


def test_a_routine_save_and_resume_hold_the_ranks_own_optimizer_share_and_the_canonical_format_the_groups():
    """The per-rank host memory of a save and the bytes a resume reads, as the plan prints
    them (Qwen2.5-7B, TP 2 on 8 GPUs: DP 4)."""
    layout = ["parallel.tensor_model_parallel_size=2", "checkpoint.save_interval=5"]
    lines = {
        fmt: {line.name: line.bytes for line in plan_memory(config(*layout, f"checkpoint.optimizer_format={fmt}"),
                                                             qwen_7b(), 80, gpus=8).save_lines}
        for fmt in ("dp_reshardable", "fully_reshardable")
    }  # fmt: skip
    stage = stage_params(config(*layout), qwen_7b(), gpus=8)
    routine, canonical = lines["dp_reshardable"], lines["fully_reshardable"]
    assert routine["save: the rank's optimizer share"] == pytest.approx(stage / 4 * 12)
    assert routine["resume: the rank's optimizer share"] == pytest.approx(stage / 4 * 12)
    # fully parallel save and load: each weight the 4 DP ranks share is written and read by one of them (bf16)
    assert (
        routine["save: the weights it writes"]
        == routine["resume: the weights it reads"]
        == pytest.approx(stage / 4 * 2)
    )
    assert not any("group" in name for name in routine)
    assert canonical["save: the DP group's gathered state"] == pytest.approx(stage * 12)
    assert canonical["resume: the DP group's whole state"] == pytest.approx(stage * 12)
    assert not plan_memory(config(*layout, "checkpoint.save_interval=0"), qwen_7b(), 80, gpus=8).save_lines


RECIPE_MODELS = {  # the H100 recipes, the architecture each reads and the GPUs it is written for
    "dapo_qwen2.5_7b_h100.yaml": ("Qwen2.5-7B", 8),
    "dapo_qwen2.5_32b_h100.yaml": ("Qwen2.5-32B", 32),
    "dapo_qwen3_30b_a3b_h100.yaml": ("Qwen3-30B-A3B", 8),
}


def recipe_plan(recipe: str):
    model, gpus = RECIPE_MODELS[recipe]
    hf = json.loads((REPO / "examples/models" / model / "config.json").read_text())
    return load_config(REPO / "examples" / recipe, []), hf, gpus


def test_the_host_memory_of_a_node_holds_the_engines_weights_the_offloaded_state_and_a_saves_staging(capsys):
    """The 7B recipe on one node: vLLM at sleep_level 1 keeps the engine's weights in pinned host memory (cached
    between sleeps), rollout.offload_actor moves the optimizer share there while generating (pinned as well), and
    a save stages the rank's share on top; `plan` prints it with the --mem to ask."""
    cfg, hf, gpus = recipe_plan("dapo_qwen2.5_7b_h100.yaml")
    host = plan_memory(cfg, hf, 80, gpus=gpus).host
    held = {line.name: line.bytes for line in host.held}
    stage = stage_params(cfg, hf, gpus=gpus)  # TP 2: a rank's parameters; DP 4 shards the optimizer
    assert held["engine weights (vllm sleep_level 1)"] == pytest.approx(8 * ModelShape.from_hf(hf).total_params() * 2)
    assert held["optimizer state (rollout.offload_actor)"] == pytest.approx(8 * stage / 4 * 12)
    assert held["the processes"] == 8 * 4 * GIB
    assert held["verifier workers"] == pytest.approx(8 * 7 * 0.25 * GIB)  # --cpus-per-task 8 less one, each rank
    passing = {line.name: line.bytes for line in host.passing}
    assert passing["a save's staging"] == pytest.approx(8 * stage / 4 * (12 + 2))  # its optimizer share, its weights
    assert host.largest_passing.name == "a save's staging"
    assert host.peak == pytest.approx(sum(held.values()) + passing["a save's staging"])
    assert host.mem_gib % 16 == 0 and 1.1 * host.peak <= host.mem_gib * GIB < 1.1 * host.peak + 16 * GIB
    plan_command(str(REPO / "examples/dapo_qwen2.5_7b_h100.yaml"), [], 80, str(QWEN_7B), gpus=8)
    out = capsys.readouterr().out
    assert (
        f"host memory a node: {host.peak / GIB:.0f} GiB (8 GPU processes; held throughout: engine weights (vllm "
        "sleep_level 1) 113 + optimizer state (rollout.offload_actor) 85 + the processes 32 + verifier workers 14; "
        "on top, at most a save's staging 99 GiB; the page cache is not counted)"
    ) in out
    assert f"sbatch: --mem={host.mem_gib}G" in out


def test_the_host_memory_counts_cpu_offload_state_and_not_twice_the_engines_that_keep_no_copy():
    cfg, hf, gpus = recipe_plan("dapo_qwen3_30b_a3b_h100.yaml")  # optimizer.cpu_offload, offload_fraction 1
    plan = plan_memory(cfg, hf, 80, gpus=gpus)
    held = {line.name: line.bytes for line in plan.host.held}
    assert held["optimizer state (optimizer.cpu_offload)"] == pytest.approx(8 * sum(x.bytes for x in plan.host_lines))
    assert "optimizer state (rollout.offload_actor)" not in held  # the hybrid optimizer's state is on the host already
    half = load_config(REPO / "examples/dapo_qwen3_30b_a3b_h100.yaml", ["optimizer.offload_fraction=0.5"])
    held_half = {line.name for line in plan_memory(half, hf, 80, gpus=8).host.held}
    assert "optimizer state (rollout.offload_actor)" not in held_half  # offload_actor leaves its GPU share there
    engine_tp4 = ModelShape.from_hf(hf).total_params() * 2 / 4
    assert held["engine weights (vllm sleep_level 1)"] == pytest.approx(8 * engine_tp4)
    for engine, sleep in (("sglang", 1), ("vllm", 2)):  # their weights are freed, not copied (the push refreshes them)
        overrides = [f"rollout.engine={engine}", f"rollout.sleep_level={sleep}"]
        other = plan_memory(load_config(REPO / "examples/dapo_qwen3_30b_a3b_h100.yaml", overrides), hf, 80, gpus=8)
        assert not any(line.name.startswith("engine") for line in other.host.held)
    assert plan_memory(config("parallel.device=cpu"), qwen_7b(), 80, gpus=8).host is None  # all host on the CPU


def test_routing_replay_adds_the_rounds_experts_to_the_rollout_data():
    cfg, hf, gpus = recipe_plan("dapo_qwen3_30b_a3b_h100.yaml")
    data = [
        next(line for line in plan_memory(c, hf, 80, gpus=gpus).host.passing if line.name == "rollout data of a step")
        for c in (cfg, load_config(REPO / "examples/dapo_qwen3_30b_a3b_h100.yaml", ["model.routing_replay=rollout"]))
    ]
    # a replica's round: 1536 prompts x 16 / 2 replicas x (1024 + 8192) tokens, 48 layers x top-8 bytes over TP 4
    round_tokens = 1536 * 16 / 2 * (1024 + 8192)
    assert data[1].bytes - data[0].bytes == pytest.approx(8 * round_tokens * 48 * 8 / 4)


@pytest.mark.parametrize("recipe", sorted(RECIPE_MODELS))
def test_each_recipes_sbatch_line_asks_the_host_memory_its_plan_prints(recipe):
    cfg, hf, gpus = recipe_plan(recipe)
    header = (REPO / "examples" / recipe).read_text().split("\nname:")[0]
    asked = re.search(r"sbatch .*--mem=(\d+)G", header)
    assert asked and int(asked.group(1)) == plan_memory(cfg, hf, 80, gpus=gpus).host.mem_gib, header[:600]
