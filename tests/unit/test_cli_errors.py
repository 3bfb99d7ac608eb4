"""Bad input ends with one clear line and exit code 2, not a traceback from deep inside."""

import importlib.util
import os
import subprocess

import pytest

from tests.warm_cli import cli_env, run_warm


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it, forked from the tests' warm server (tests/warm_cli.py)."""
    return run_warm(list(args), cli_env(), 300)


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.clip_hgh=0.3", "unknown config key 'algorithm.clip_hgh'.*did you mean 'algorithm.clip_high'"),
        ("data.source=no/such/prompts.jsonl", "data.source: file not found: no/such/prompts.jsonl"),
        ("parallel.tensor_model_parallel_size=2", "TP=2 x PP=1 = 2 ranks does not divide the world size 1"),
        (
            "parallel.tensor_model_parallel_size=3",
            "4 attention heads do not split over parallel.tensor_model_parallel_size=3",
        ),
    ],
)
def test_bad_input_is_one_clear_line(override, message, tiny_llama_dir, tmp_path):
    proc = run_cli(
        "train",
        "examples/smoke_cpu.yaml",
        f"model.hf_path={tiny_llama_dir}",
        f"logging.run_dir={tmp_path}/run",
        "logging.wandb.mode=disabled",
        "logging.plot=false",
        override,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    import re

    assert re.search("dapo-mcore: error: .*" + message, proc.stderr), proc.stderr


def test_missing_recipe_file():
    proc = run_cli("config", "examples/nope.yaml")
    assert proc.returncode == 2 and "config file not found" in proc.stderr


def test_config_command_prints_the_resolved_config():
    proc = run_cli("config", "examples/smoke_cpu.yaml", "algorithm.clip_high=0.31")
    assert proc.returncode == 0 and "clip_high: 0.31" in proc.stdout


def test_check_reads_every_prompt_row_before_a_job_is_submitted(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n{"prompt": "What is 2+2?"}\n')
    proc = run_cli("check", "examples/smoke_cpu.yaml", f"data.source={bad}", f"logging.run_dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-2:] == [
        "the run would not start: 1 problem:",
        f"  - {bad}:2: missing key 'answer' (keys present: ['prompt'])",
    ]
    good = run_cli(
        "check",
        "examples/smoke_cpu.yaml",
        f"logging.run_dir={tmp_path}/run",
        "data.eval_files=examples/data/sums.jsonl",
    )
    assert good.returncode == 0 and good.stdout.strip().splitlines()[-1].endswith("is ready to launch")
    assert "held-out examples/data/sums.jsonl (20)" in good.stdout
    assert f"starts at step 0 in {tmp_path}/run" in good.stdout


def test_check_lists_every_problem_train_would_meet_in_one_pass(tmp_path):
    """It stopped at the first problem, and said "ready to launch" with the engine the config names not
    installed, or an engine / model pair train refuses (vLLM's CPU build and experts)."""
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "What is 2+2?"}\n')
    (tmp_path / "saves" / "step_000003").mkdir(parents=True)  # another run's, where this one would save
    proc = run_cli(
        "check", "examples/smoke_cpu.yaml", "model.hf_path=examples/models/tiny-arith-moe", "rollout.engine=vllm",
        "parallel.pipeline_model_parallel_size=0", "algorithm.clip_low=2", f"data.source={bad}",
        f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/saves",
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    problems = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert problems == [
        "parallel.pipeline_model_parallel_size must be >= 1, got 0",
        "algorithm.clip_low must be in [0, 1), got 2.0",
        "rollout.engine=vllm on the CPU cannot take weight pushes into a mixture-of-experts model's experts "
        "(vLLM's CPU MoE kernels; docs/engines.md): use rollout.engine=hf or sglang on the CPU",
        f"{bad}:1: missing key 'answer' (keys present: ['prompt'])",
        f"checkpoint.dir {tmp_path}/saves holds saves of an earlier run: continue it with checkpoint.resume=auto, "
        "or give this run another checkpoint.dir",
    ]
    assert "the run would not start: 5 problems:" in proc.stderr


def test_check_names_a_missing_engine_package_and_says_an_earlier_run_will_be_moved_aside(tmp_path):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here (the suite runs it from its own environment: tests/engines/sglang_cpu)")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = run_cli("check", "examples/smoke_cpu.yaml", "rollout.engine=sglang", f"logging.run_dir={run_dir}")
    assert proc.returncode == 2
    wanted = "  - rollout.engine=sglang needs the 'sglang' package: pip install -c requirements/torch2.14-sglang0.5.23"
    assert wanted in proc.stderr
    assert f"{run_dir} holds an earlier run: train moves it to run.prev-<time> and starts at step 0" in proc.stderr


def test_check_names_what_optimizer_cpu_offload_needs(tmp_path):
    """On the CPU it needs a GPU; on a GPU, Transformer Engine (Megatron's precision-aware optimizer checks its
    version: without it the run failed with a TypeError inside Megatron's config, seen on an H200)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    run = ("check", "examples/smoke_cpu.yaml", "optimizer.cpu_offload=true", f"logging.run_dir={tmp_path}/run")
    on_cpu, on_gpu = run_cli(*run), run_cli(*run, "parallel.device=cuda")
    assert on_cpu.returncode == 2 and "  - optimizer.cpu_offload needs a GPU" in on_cpu.stderr
    assert on_gpu.returncode == 2
    assert (
        "  - optimizer.cpu_offload (Megatron's precision-aware optimizer) needs Transformer Engine: "
        "transformer_engine is not installed" in on_gpu.stderr
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "-8"], "argument --gpus: -8 is not a count >= 1"),  # planned "DP -4" with negative memory
        (["--gpus", "0"], "argument --gpus: 0 is not a count >= 1"),  # silently planned for 8
        (["--gpu-gb", "-80"], "argument --gpu-gb: -80 is not a size > 0"),
        (["--gpu-gb", "nan"], "argument --gpu-gb: nan is not a size > 0"),
        (["--gpus", "eight"], "argument --gpus: 'eight' is not a number"),
    ],
)
def test_plan_refuses_counts_and_sizes_that_are_not_positive(args, message, capsys):
    from dapo_mcore.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["plan", "examples/smoke_cpu.yaml", *args])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_check_reads_the_weights_headers_and_imports_the_user_functions(tmp_path):
    """`check` said "ready to launch" for a cut-short model.safetensors, weights of another shape than config.json
    and a verifier module that does not exist; train refused or crashed on each."""
    import json
    import shutil

    cut, wide = tmp_path / "cut", tmp_path / "wide"
    for copy in (cut, wide):
        shutil.copytree("examples/models/tiny-arith", copy)
    with open(cut / "model.safetensors", "r+b") as weights:
        weights.truncate(10_000)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    run = ("check", "examples/smoke_cpu.yaml", "model.init=hf", f"logging.run_dir={tmp_path}/run")
    problems = {
        name: [line[4:] for line in run_cli(*run, *extra).stderr.splitlines() if line.startswith("  - ")]
        for name, extra in (
            ("cut", [f"model.hf_path={cut}"]),
            ("wide", [f"model.hf_path={wide}"]),
            ("verifier", ["algorithm.reward.verifier=no_such_module:is_correct"]),
        )
    }
    assert problems["cut"] == [f"{cut}/model.safetensors is cut short: 10,000 bytes, its header needs 546,144 (an "
                               "interrupted copy or download?)"]  # fmt: skip
    assert problems["wide"][0] == (
        f"{wide}: 'model.layers.0.mlp.gate_proj.weight' has shape [192, 64] in model.safetensors, config.json makes "
        "it [256, 64]"
    )
    assert problems["wide"][-1] == f"{wide}: 3 more tensors differ in shape from config.json"
    assert problems["verifier"] == [
        "algorithm.reward.verifier: verifier (one of ['dapo', 'gsm8k', 'math_verify', 'synthetic'] or) "
        "'no_such_module:is_correct' cannot be loaded: No module named 'no_such_module'"
    ]


def test_an_override_that_is_not_yaml_is_one_line(capsys):
    """`data.ops=*` (a YAML alias) was 7 lines of parser context."""
    from dapo_mcore.cli import main

    assert main(["config", "examples/smoke_cpu.yaml", "data.ops=*"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith(
            "dapo-mcore: error: override 'data.ops=*': the value is not valid YAML (while scanning an alias: expected "
            "alphabetic or numeric character"
        )
        and err.strip().endswith("quote it to pass text, e.g. data.ops='*'")
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_prompt_len=3", "tokens, longer than the 3 allowed (data.max_prompt_len); "),
        ("rollout.sampling.max_response_len=900000", "max_response_len=900000 leaves no room for a prompt"),
    ],
)
def test_check_refuses_the_prompt_lengths_train_refuses(tmp_path, override, message):
    """`check` said "ready to launch" where train refused: prompts longer than the prompt budget, an answer budget
    past the model's positions. It now runs train's own prompt setup. Options may follow the overrides too."""
    run = ["examples/smoke_cpu.yaml", "data.source=examples/data/sums.jsonl", f"logging.run_dir={tmp_path}/run"]
    proc = run_cli("check", *run[:2], "--gpus", "1", *run[2:], override)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr


def test_check_names_a_live_run_holding_the_run_directory(tmp_path):
    from dapo_mcore.utils.run_lock import RunLock

    run_dir = tmp_path / "run"
    lock = RunLock(run_dir)
    lock.acquire()  # this process, alive: a live run
    try:
        proc = run_cli("check", "examples/smoke_cpu.yaml", f"logging.run_dir={run_dir}")
        assert proc.returncode == 2 and f"  - run directory {run_dir} is in use by the run of pid {os.getpid()}" in (
            proc.stderr
        )
        assert RunLock(run_dir).live_holder_problem() is not None and lock.path.exists()  # looked, not taken
    finally:
        lock.release()
    assert RunLock(run_dir).live_holder_problem() is None


@pytest.mark.parametrize(
    ("reason", "message", "stopped"),
    [
        (
            "SIGTERM at once",
            "[pair.cc:553] Connection closed by peer [127.0.0.1]:48873. This is typically ...",
            "SIGTERM",
        ),
        ("SIGTERM", "Connection reset by peer", "SIGTERM"),
        ("SIGINT at once", "Connection closed by peer", "SIGINT"),
        (None, "Connection closed by peer", None),  # no stop under way: a peer that died is other news
        ("SIGTERM at once", "a bug", None),
    ],
)
def test_a_collective_a_stopping_peer_broke_is_this_ranks_stop_not_a_traceback(monkeypatch, reason, message, stopped):
    """torchrun's death is each rank's SIGTERM: a peer that stops at once leaves this rank inside a gloo collective,
    which fails before its own handler runs (a 45-line traceback around the stop, seen in a suite run)."""
    from dapo_mcore import cli, launch

    monkeypatch.setattr(launch, "requested_stop", lambda: reason)
    assert cli._stopping_signal(RuntimeError(message)) == stopped
