"""A dead peer ends the job in bounded time (dapo_mcore/parallel/liveness.py), on 3 gloo ranks.

A rank frozen with SIGSTOP stands for a node that died: its sockets stay open and say nothing, as a host whose
link went down. Without the watch the others would wait in their all_reduce for the process group's timeout
(30 minutes); with parallel.peer_timeout_s = 4 they must exit 76 within seconds, naming what they lost.

This file is also the launcher: `python tests/dist/test_liveness.py OUT_DIR SCENARIO...` imports torch and
Megatron-Core once, then forks the 3 ranks of every scenario at once (a fresh interpreter per rank would import
for ~10 s each on the 2-core machine), in srun's layout (rank 0 hosts the store) or torchrun's (an agent
process does), and writes what each rank did to OUT_DIR/results.json. Each rank's output is its own log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEER_TIMEOUT_S = 4.0
WORLD = 3
BOUND_S = 20.0  # far below the 30-minute collective timeout the ranks would otherwise wait for
FROZEN = {"rank2_frozen": 2, "rank0_frozen": 0, "rank0_frozen_agent_store": 0}  # scenario -> the rank it stops


# ---- the tests ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every scenario, run at once by one launcher (one import of Megatron-Core for all): ~30 s."""
    out = tmp_path_factory.mktemp("liveness")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, str(out), *FROZEN, "staggered_ends"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, f"the launcher failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-8000:]}"
    return json.loads((out / "results.json").read_text())


def survivors_stop_naming(result: dict, frozen: int, *names: str) -> None:
    for rank in sorted(set(range(WORLD)) - {frozen}):
        seen = result[str(rank)]
        log = seen["log"]
        assert seen["code"] == 76, f"rank {rank} exited {seen['code']}, not 76 (peer lost):\n{log[-3000:]}"
        assert seen["after_stop_s"] < BOUND_S, f"rank {rank} took {seen['after_stop_s']:.1f} s:\n{log[-3000:]}"
        lines = [line for line in log.splitlines() if "peer lost:" in line]
        assert len(lines) == 1, f"rank {rank}: not one 'peer lost' line:\n{log[-3000:]}"
        for name in names:
            assert name in lines[0], f"rank {rank}'s line does not name {name!r}: {lines[0]}"


def test_a_frozen_rank_or_store_host_ends_the_other_ranks_with_exit_76_in_seconds(results):
    host = socket.gethostname()
    # (a) rank 2's node is gone: rank 0 notices its counter stopped, the verdict reaches rank 1
    survivors_stop_naming(results["rank2_frozen"], 2, f"rank 2 on host {host}", "judged by rank 0")
    # (b) rank 0's node is gone under srun: rank 0 served the store, which stops answering
    survivors_stop_naming(results["rank0_frozen"], 0, "the store at 127.0.0.1:", f"rank 0's host, {host}")
    # (b) under torchrun: the agent's store lives on, rank 0's counter stops
    survivors_stop_naming(results["rank0_frozen_agent_store"], 0, f"rank 0 on host {host}")
    assert "peer lost" not in results["rank2_frozen"]["2"]["log"], "the frozen rank cannot have spoken"


def test_ranks_that_end_at_different_times_all_exit_0(results):
    """Rank 2 leaves first (destroy_parallel), rank 0 (the judge, under srun the store's host) 1.5 timeouts
    later by the interpreter's normal exit, rank 1 after 3 timeouts: nobody is taken for lost."""
    result = results["staggered_ends"]
    for rank in range(WORLD):
        seen = result[str(rank)]
        assert seen["code"] == 0, f"rank {rank} exited {seen['code']}:\n{seen['log'][-3000:]}"
        assert "peer lost" not in seen["log"]
    apart_s = result["1"]["done_s"] - result["2"]["done_s"]
    assert apart_s > 2.5 * PEER_TIMEOUT_S, f"the ends were only {apart_s:.1f} s apart"


# ---- the launcher (python tests/dist/test_liveness.py OUT_DIR SCENARIO...) ----------------------------------
def rank_main(scenario: str, rank: int, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from dapo_mcore.parallel import destroy_parallel, init_parallel
    from dapo_mcore.utils.logging import setup_logging

    setup_logging(rank)
    init_parallel(1, 1, "cpu", peer_timeout_s=PEER_TIMEOUT_S)
    dist.barrier()  # every rank is past its start: the frozen one stops while the others are in the all_reduce
    if FROZEN.get(scenario) == rank:
        (out / f"{scenario}.stopped").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))
    if scenario == "staggered_ends":
        if rank == 2:
            destroy_parallel()
        elif rank == 0:
            time.sleep(1.5 * PEER_TIMEOUT_S)  # then the interpreter's normal exit: atexit marks it as left
        else:
            time.sleep(3 * PEER_TIMEOUT_S)
            destroy_parallel()
    print(f"rank {rank} done", flush=True)
    # its own clock, before the interpreter's exit: on a loaded machine an exit can take seconds
    (out / f"{scenario}.rank{rank}.done").write_text(str(time.time()))
    return 0


def become_rank(scenario: str, rank: int, port: int, out: Path, agent_store: bool) -> None:
    """In the forked child: its own log, its rank's environment, then the scenario; leaves by sys.exit, so that
    the interpreter's normal exit runs (atexit) as in any command."""
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # dies with the launcher, whatever ends it
    log = os.open(out / f"{scenario}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # every rank on this host, said as torchrun says it: a LOCAL_WORLD_SIZE or SLURM_NNODES left in the test
    # process's environment made the ranks a job across hosts, whose preflight refuses a loopback host name
    env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
               MASTER_ADDR="127.0.0.1")  # fmt: skip
    for variable in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        os.environ.pop(variable, None)
    os.environ.update(env, MASTER_PORT=str(port))
    if agent_store:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    sys.exit(rank_main(scenario, rank, out))


def serve_store(port: int) -> None:
    """In the forked child: torchrun's agent, which hosts the store the ranks rendezvous on."""
    import ctypes

    import torch.distributed as dist

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    while store is not None:
        time.sleep(60)


def launcher(out: Path, scenarios: list[str]) -> None:
    # imported once, before any fork: the ranks start at once (nothing of torch runs here, no threads to inherit)
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.process_groups_config  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401

    from tests.conftest import free_port

    pids: dict[int, tuple[str, int]] = {}  # pid -> (scenario, rank); rank -1: an agent's store
    for scenario in scenarios:
        port = free_port()
        agent_store = scenario.endswith("agent_store")
        if agent_store:
            pid = os.fork()
            if pid == 0:
                serve_store(port)
            pids[pid] = (scenario, -1)
        for rank in range(WORLD):
            pid = os.fork()
            if pid == 0:
                become_rank(scenario, rank, port, out, agent_store)  # never returns: exits the child
            pids[pid] = (scenario, rank)
    try:
        ended = watch_ranks(pids)
    finally:
        for pid in pids:  # the frozen ranks and the agents (SIGKILL ends a stopped process too)
            kill_and_reap(pid)
    write_results(out, scenarios, pids, ended)


def watch_ranks(pids: dict[int, tuple[str, int]]) -> dict[int, tuple[int, float]]:
    """pid -> (exit code, time.time() at the exit), until every rank that runs has exited or 60 s passed."""
    running = {pid for pid, (scenario, rank) in pids.items() if rank >= 0 and FROZEN.get(scenario) != rank}
    ended: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + 60
    while running and time.monotonic() < deadline:
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ended[pid] = (os.waitstatus_to_exitcode(status), time.time())
                running.discard(pid)
        time.sleep(0.05)
    return ended


def kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def write_results(out: Path, scenarios: list[str], pids: dict, ended: dict) -> None:
    results: dict = {scenario: {} for scenario in scenarios}
    for pid, (scenario, rank) in pids.items():
        if rank < 0:
            continue
        code, at = ended.get(pid, (None, None))
        stopped = out / f"{scenario}.stopped"
        after_stop = at - float(stopped.read_text()) if at is not None and stopped.exists() else None
        log = (out / f"{scenario}.rank{rank}.log").read_text(errors="replace")
        done = out / f"{scenario}.rank{rank}.done"
        done_s = float(done.read_text()) if done.exists() else None
        results[scenario][str(rank)] = dict(code=code, ended_s=at, done_s=done_s, after_stop_s=after_stop, log=log)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    launcher(Path(sys.argv[1]), sys.argv[2:])
