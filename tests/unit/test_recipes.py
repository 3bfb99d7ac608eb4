"""The DAPO recipes for H100 nodes (Qwen2.5-7B, Qwen2.5-32B, Qwen3-30B-A3B): they carry the paper's settings,
pass the config checks that need no weights or data, and the memory planner says they fit 80 GB at the GPU
counts they are written for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_mcore.config import load_config, validate
from dapo_mcore.config.model_spec import read_model_spec
from dapo_mcore.mcore.provider import check_model_layout
from dapo_mcore.plan import GIB, plan_memory

REPO = Path(__file__).resolve().parents[2]
RECIPES = {  # recipe -> (architecture shipped in examples/models, GPUs it is laid out for)
    "dapo_qwen2.5_7b_h100.yaml": ("Qwen2.5-7B", 8),
    "dapo_qwen2.5_32b_h100.yaml": ("Qwen2.5-32B", 32),
    "dapo_qwen3_30b_a3b_h100.yaml": ("Qwen3-30B-A3B", 8),
}
WEIGHTS = {"Qwen3-30B-A3B": "Qwen3-30B-A3B-Base"}  # where the recipe downloads them, when not the model's name


def load(recipe: str, tmp_path: Path, *overrides: str):
    """The recipe with its weights and data pointed at what exists here: the shipped config.json, empty files."""
    model, _ = RECIPES[recipe]
    (tmp_path / "train.jsonl").write_text('{"prompt": "1 + 1 = ?", "answer": "2"}\n')
    (tmp_path / "aime.jsonl").write_text('{"prompt": "2 + 2 = ?", "answer": "4"}\n')
    return load_config(
        REPO / "examples" / recipe,
        [
            f"model.hf_path={REPO / 'examples/models' / model}",
            f"data.source={tmp_path / 'train.jsonl'}",
            f"data.eval_files={tmp_path / 'aime.jsonl'}",
            f"logging.run_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_carries_the_papers_settings(recipe, tmp_path):
    cfg = load(recipe, tmp_path)
    ro, algo, opt = cfg.rollout, cfg.algorithm, cfg.optimizer
    assert (opt.lr, opt.warmup_steps, opt.weight_decay, opt.clip_grad) == (1e-6, 20, 0.1, 1.0)
    assert (ro.prompts_per_step, ro.n_samples_per_prompt, cfg.trainer.mini_batch_size) == (512, 16, 512)
    assert ro.gen_prompts_per_round == 3 * ro.prompts_per_step and algo.dynamic_sampling.max_rounds == 10
    assert (ro.sampling.max_response_len, algo.overlong.buffer_len) == (20480, 4096)
    assert (algo.clip_low, algo.clip_high, algo.dual_clip_c, algo.loss_agg) == (0.2, 0.28, 10.0, "token-mean")
    assert algo.dynamic_sampling.enabled and algo.kl.beta == 0.0 and algo.reward.verifier == "dapo"
    assert (cfg.model.dtype, ro.engine, ro.sampling.temperature) == ("bfloat16", "vllm", 1.0)
    # the engine holds exactly one longest prompt + response
    assert ro.max_model_len == cfg.data.max_prompt_len + ro.sampling.max_response_len


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_passes_the_checks_that_need_no_weights(recipe, tmp_path):
    cfg = load(recipe, tmp_path)
    validate(cfg)
    par = cfg.parallel
    spec = read_model_spec(json.loads((Path(cfg.model.hf_path) / "config.json").read_text()))
    check_model_layout(
        spec,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        par.virtual_pipeline_model_parallel_size,
        par.expert_model_parallel_size,
        par.expert_tensor_parallel_size,
    )
    assert cfg.data.max_prompt_len + cfg.rollout.sampling.max_response_len <= spec.max_position_embeddings


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_names_the_weights_to_download_under_models(recipe):
    model, _ = RECIPES[recipe]
    assert load_config(REPO / "examples" / recipe).model.hf_path == f"models/{WEIGHTS.get(model, model)}"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_plan_says_the_recipe_fits_h100_80gb(recipe, tmp_path):
    model, gpus = RECIPES[recipe]
    cfg = load(recipe, tmp_path)
    plan = plan_memory(cfg, json.loads((REPO / "examples/models" / model / "config.json").read_text()), 80, gpus)
    assert plan.fits, plan.peak
    assert plan.peak.total < 0.8 * 80 * GIB  # a fifth of the GPU left for what the plan does not model
    assert plan.kv.tokens >= 20 * plan.kv.sequence  # at least 20 full-length answers decode at once per replica
    # the engine starts before the actor allocates (build.py start_engine): its share is free then, with room
    start = plan.engine_start
    assert start.asked == cfg.rollout.gpu_memory_utilization * 80 * GIB
    assert start.fits and start.free - start.asked > 20 * GIB


def test_a_share_the_gpu_cannot_give_at_engine_start_fails_the_plan(tmp_path):
    """vLLM refuses to start unless gpu_memory_utilization x the GPU is free: a plan that asks more than the
    GPU has beside the CUDA context says so, and what to change."""
    from dapo_mcore.plan import format_plan

    model, gpus = RECIPES["dapo_qwen2.5_7b_h100.yaml"]
    cfg = load("dapo_qwen2.5_7b_h100.yaml", tmp_path, "rollout.gpu_memory_utilization=0.99")
    plan = plan_memory(cfg, json.loads((REPO / "examples/models" / model / "config.json").read_text()), 80, gpus)
    assert not plan.engine_start.fits and not plan.fits
    text = format_plan(plan)
    assert "engine start: asks 79.2 GiB free" in text and "SHORT by 0.7 GiB" in text
    assert "the engine would be refused at start" in text
    assert any("gpu_memory_utilization=0.89" in s.change for s in plan.suggestions)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_recipes_sbatch_line_gives_the_job_its_time_and_the_save_signal(recipe):
    """slurm/train.sbatch's own --time is 4 hours: about two steps of these recipes at an 8k mean answer
    (`dapo-mcore plan`: 1.4-2.1 h a step), spent mostly on start-up and saves. The line a user copies says it."""
    import re

    header = (REPO / "examples" / recipe).read_text().split("\nname:")[0]
    line = re.search(r"sbatch (.*)slurm/train\.sbatch", header).group(1)
    hours = re.search(r"--time=(\d+):\d\d:\d\d", line)
    assert hours and int(hours.group(1)) >= 12, line
    assert re.search(r"--signal=B:USR1@\d+", line), line


def test_plan_of_the_32b_recipe_at_cp2_gives_the_activations_a_gpu_beside_cp1s(tmp_path):
    """Context parallelism splits each sequence over CP ranks: a rank's activations halve at CP 2 (the recipe's
    32,768-token budget under full recompute: 2.50 GiB at CP 1, 1.25 at CP 2), the distributed optimizer shards
    over DP x CP, and the K/V all-gather is a transient of its own."""
    from dapo_mcore.plan import format_plan

    model, gpus = RECIPES["dapo_qwen2.5_32b_h100.yaml"]
    hf = json.loads((REPO / "examples/models" / model / "config.json").read_text())
    plan = plan_memory(load("dapo_qwen2.5_32b_h100.yaml", tmp_path, "parallel.context_parallel_size=2"), hf, 80, gpus)
    text = format_plan(plan)
    assert "TP 8 + SP x PP 1 x CP 2 x DP 2" in text
    assert "context parallelism 2: actor activations 1.25 GiB a GPU, 16384 of each micro-batch's 32768 tokens (at " \
        "CP 1 on these GPUs: 2.50 GiB)" in text  # fmt: skip
    assert "K/V all-gather (context parallel)" in text and "/ DP 2 x CP 2" in text
    at_cp1 = plan_memory(load("dapo_qwen2.5_32b_h100.yaml", tmp_path), hf, 80, gpus)
    assert "context parallelism" not in format_plan(at_cp1) and "x CP" not in at_cp1.layout
