"""A run prints its own lines only: no engine logging, no wandb banner or advertisement, no library warning a
user would take for a bug (logging.engine_log=quiet, the default); wandb's service ends with the run."""

from __future__ import annotations

import logging
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import psutil

from dapo_mcore.rollout.vllm_engine import _HarmlessReloadWarning
from dapo_mcore.utils.metrics_log import MetricsWriter, WandbOptions, read_metrics
from tests.conftest import REPO
from tests.e2e.test_train_cli import cli
from tests.warm_cli import cli_env, run_warm

TINY = ["trainer.steps=2", "rollout.prompts_per_step=4", "rollout.gen_prompts_per_round=4",
        "trainer.mini_batch_size=16", "trainer.micro_batch_size=16", "checkpoint.save_interval=0",
        "logging.progress=false"]  # fmt: skip
OURS = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) |^step \d+/\d+ |^dapo-mcore: ")
# vLLM's CPU build warns through c10's logging ("NUMA binding: Using MEMBIND policy"), whose level is read
# once, when torch is imported: no engine setting reaches it. The CUDA build has no such line.
CPU_BUILD_NOTE = re.compile(r"^(\[rank\d+\]:)?\[W\d+ [\d:.]+ utils\.cpp:\d+\] Warning: NUMA binding")


def foreign_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip() and not OURS.match(line)]


def test_a_vllm_run_prints_no_engine_log_nor_wandb_advertisement(tmp_path):
    """Before: ~40 lines of vLLM INFO and WARNING (on stdout), "RotaryEmbedding: Failed to load weights" at every
    weight push, Python deprecation warnings from vLLM's code, and wandb's Weave advertisement (vLLM imports
    openai) on stderr. wandb stays offline, the default."""
    run_dir = tmp_path / "run"
    proc = cli("train", "examples/smoke_cpu.yaml", *TINY, "rollout.engine=vllm", f"logging.run_dir={run_dir}")
    assert foreign_lines(proc.stdout) == []
    assert [line for line in foreign_lines(proc.stderr) if not CPU_BUILD_NOTE.match(line)] == []
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"


# What `dapo-mcore eval SAVE` runs before its engine starts.
CONVERT_FOR_EVAL = """import sys; from pathlib import Path; from dapo_mcore.evaluate import converted_to_hf
converted_to_hf(Path(sys.argv[1]), Path(sys.argv[2]))"""


def test_evaluating_a_converted_save_prints_no_transformer_engine_or_deprecation_warning(tmp_path):
    """Before: Megatron-Core's four 'Transformer Engine and Apex are not installed' warnings on import and two
    FutureWarnings of its checkpoint loader. A process of its own, with Python's default warnings filter, as a
    user's command: Megatron warns once per process, when it is imported."""
    mcore = tmp_path / "mcore"
    converted = run_warm([str(REPO / "examples/models/tiny-arith"), str(mcore)], cli_env(), timeout=300,
                         script=REPO / "tools/convert_hf_to_mcore.py")  # fmt: skip
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert converted.stdout.startswith(f"wrote {mcore}: "), converted.stdout  # one line on success
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", CONVERT_FOR_EVAL, str(mcore), str(tmp_path / "hf")]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    assert (tmp_path / "hf" / "config.json").is_file()


def test_wandb_shows_no_advertisement_takes_group_and_tags_and_ends_its_service_on_close(tmp_path, capfd):
    """wandb advertises Weave when openai is imported (vLLM imports it). close() ends wandb's service process
    at once: a stopped run's CLI ends the processes left (cli.py), and wandb's exit hook then wrote to the dead
    service ("Exception ignored in atexit callback ... ConnectionResetError" after the stop line)."""
    import openai  # noqa: F401 (what vLLM imports; wandb looks for it)

    options = WandbOptions("offline", "p", group="sweep-1", tags=["7b", "baseline"])
    writer = MetricsWriter(tmp_path, options, run_name="r", config={"a": 1})
    for step in (1, 2):
        writer.write(step, {"loss": 0.5})
    writer.close()
    assert not [p for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb")]
    assert "wandb" not in capfd.readouterr().err
    run = next(r.run for r in wandb_records(tmp_path) if r.HasField("run"))
    assert (run.run_group, list(run.tags)) == ("sweep-1", ["7b", "baseline"])
    assert wandb_history_steps(tmp_path) == [1, 2]


# A run's metrics writer while Slurm's SIGTERM (scancel, the time limit) reaches every process of the job, wandb's
# service too, and the run finishes its step and saves.
WANDB_SERVICE_KILLED = """import sys, psutil
from pathlib import Path
from dapo_mcore.utils.metrics_log import MetricsWriter, WandbOptions
writer = MetricsWriter(Path(sys.argv[1]), WandbOptions("offline", "p"))
run_id = writer.wandb_run_id
writer.write(1, {"loss": 0.5})
service = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb")]
for p in service:
    p.terminate()
psutil.wait_procs(service, timeout=30)
writer.write(2, {"loss": 0.4})
assert writer.wandb_run_id == run_id, "the stop's save would record no wandb run: the next job would start another"
writer.close()"""


def test_a_run_whose_wandb_service_was_killed_goes_on_with_metrics_jsonl(tmp_path):
    """Before: the next wandb.log raised ConnectionResetError, and the run failed instead of saving."""
    command = [sys.executable, "-c", WANDB_SERVICE_KILLED, str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr and "step 2 on goes to metrics.jsonl only" in proc.stderr
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_the_rotary_table_line_of_a_vllm_weight_push_is_dropped_and_other_layers_are_kept():
    def reload_warning(layer: str) -> logging.LogRecord:
        return logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights",
                                 (layer,), None)  # fmt: skip

    assert not _HarmlessReloadWarning().filter(reload_warning("RotaryEmbedding"))
    assert _HarmlessReloadWarning().filter(reload_warning("QKVParallelLinear"))


# ---- reading an offline wandb run -----------------------------------------------------------------------------
def wandb_records(run_dir: Path) -> list:
    """The protobuf Records of the run's newest offline wandb log (run-ID.wandb): a 7-byte file header, then
    LevelDB-log chunks in 32 KiB blocks, each chunk with a 7-byte header (CRC-32, length, type: 1 full, 2 first,
    3 middle, 4 last), a block's last bytes left as padding when a header would not fit."""
    from wandb.proto import wandb_internal_pb2

    path = max(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    data, pos, chunk, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def wandb_history_steps(run_dir: Path) -> list[int]:
    """The steps wandb holds rows of; [] unless the run was closed (its exit record written)."""
    records = wandb_records(run_dir)
    if not any(r.HasField("exit") for r in records):
        return []
    return [r.history.step.num for r in records if r.HasField("history")]


def test_a_converter_error_is_its_one_line_without_megatrons_import_notes(tmp_path):
    """Before: 8 lines of 'Transformer Engine and Apex are not installed' warnings above the error. Python's
    default warnings filter, as a user's command."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"OMP_NUM_THREADS": "1"}
    for tool in ("convert_hf_to_mcore.py", "convert_mcore_to_hf.py"):
        command = [sys.executable, str(REPO / "tools" / tool), str(tmp_path / "nothing"), str(tmp_path / "out")]
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
