"""The tests' warm runner (tests/warm_cli.py): a second server for an environment forked from its zygote (not a
fresh interpreter), a dead server replaced; several ranks forked as torchrun would start them; on a GPU machine no
fork (CUDA refuses a forked child), each run a fresh interpreter (torchrun for ranks) with the same argv,
environment, working directory and result."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests import warm_cli
from tests.conftest import free_port


def test_on_a_gpu_machine_runs_are_fresh_processes_with_the_same_result(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_cli, "forking_is_unsafe", lambda: True)
    script = tmp_path / "probe.py"
    script.write_text("import os, sys\nprint(sys.argv[1:], os.environ['PROBE'], os.getcwd())\nsys.exit(3)\n")
    monkeypatch.setattr(warm_cli, "WarmCli", None)  # any use of a warm server fails the test
    proc = warm_cli.run_warm(["a", 1], {"PROBE": "yes", "PATH": "/usr/bin:/bin"}, 60, script=script, cwd=tmp_path)
    assert proc.returncode == 3
    assert proc.stdout.strip() == f"['a', '1'] yes {tmp_path}"
    assert proc.args[:2] == [sys.executable, str(script)]


def test_on_a_gpu_machine_a_started_run_can_be_signalled_and_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_cli, "forking_is_unsafe", lambda: True)
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    # an ignored SIGTERM is inherited across exec: a pytest worker left with it ignored by an earlier test made this
    # run outlive the signal (seen once in a suite run); a real launcher's is the default
    saved = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        proc = warm_cli.start_warm([], {"PATH": "/usr/bin:/bin"}, 60, script=script, cwd=tmp_path)
    finally:
        signal.signal(signal.SIGTERM, saved)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM


RANK_PROBE = """import os, sys
warm = "torch" in sys.modules  # preloaded by the server: the rank is a fork, not a fresh interpreter
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# one write: the ranks share the pipe, and print's separate writes of its parts interleaved ("rankrank 1 1 ...")
print(" ".join(map(str, ["rank", *(os.environ.get(k) for k in keys), warm, sys.argv[1:]])), flush=True)
"""


def test_ranks_fork_from_the_warm_server_with_an_env_rendezvous_and_share_the_output(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_PROBE)
    env = {**warm_cli.cli_env(), "MASTER_PORT": "41234"}
    proc = warm_cli.run_warm(["x"], env, 300, script=script, cwd=tmp_path, ranks=3)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} {r} 3 3 127.0.0.1 41234 True ['x']" for r in range(3)], proc.stdout
    assert proc.args[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node=3", "--master_addr=127.0.0.1"]


def test_a_failing_rank_ends_the_others_and_gives_the_launch_its_exit_code(tmp_path):
    script = tmp_path / "one_fails.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(3600)\n")
    # rank 0 must be ended by the launch: at the timeout the server would end it and run_warm raise
    proc = warm_cli.run_warm([], {**warm_cli.cli_env(), "MASTER_PORT": "1"}, 600, script=script, ranks=2)
    assert proc.returncode == 3
    assert "warm launch: rank 1 ended with exit code 3; ending the other ranks" in proc.stderr


def test_on_a_gpu_machine_ranks_are_started_by_torchrun(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_cli, "forking_is_unsafe", lambda: True)
    monkeypatch.setattr(warm_cli, "WarmCli", None)
    script = tmp_path / "ranks.py"
    script.write_text(RANK_PROBE)
    env = {**warm_cli.cli_env(), "MASTER_PORT": str(free_port())}
    proc = warm_cli.run_warm(["x"], env, 300, script=script, cwd=tmp_path, ranks=2)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("rank ")) == ["0", "1"]
    assert f"--master_port={env['MASTER_PORT']}" in proc.args


SERVER_PROBE = """import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(str(os.getppid()))  # the run's parent: its server
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(float(sys.argv[2]))
"""


def parent_and_cpu(pid: int) -> tuple[int, float]:
    """A process's parent and the CPU seconds it has used itself (/proc/PID/stat's ppid, utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def written_by(runs: list, files: list[Path]) -> list[str]:
    """What the running `runs` wrote to `files`, once every file is there."""
    deadline = time.monotonic() + 240
    while not all(f.exists() for f in files):
        assert all(run.poll() is None for run in runs) and time.monotonic() < deadline, [r.communicate() for r in runs]
        time.sleep(0.1)
    return [f.read_text() for f in files]


def test_a_second_server_for_an_environment_is_a_fork_of_the_zygote_and_a_dead_one_is_replaced(tmp_path):
    if warm_cli.forking_is_unsafe():
        pytest.skip("a GPU machine runs no server")
    script = tmp_path / "server_of.py"
    script.write_text(SERVER_PROBE)
    files = [tmp_path / "server-0", tmp_path / "server-1"]
    # two runs at once: two servers for the environment
    runs = [warm_cli.start_warm([f, 600], warm_cli.cli_env(), 300, script=script, cwd=tmp_path) for f in files]
    try:
        servers = [int(text) for text in written_by(runs, files)]
    finally:
        for run in runs:
            run.kill()
            run.wait(timeout=60)
    assert servers[0] != servers[1]
    (zygote, _), (other_zygote, _) = map(parent_and_cpu, servers)
    # a fresh interpreter would be this process's child. (Not the servers' CPU: in a suite they are the worker's,
    # and each fork of a run costs its server some; one had 3 CPU-s there.)
    assert zygote == other_zygote != os.getpid()
    assert parent_and_cpu(zygote)[0] == os.getpid()
    # the zygote paid the imports (torch, Megatron, transformers: 4.6-7 s of CPU seen; a bare interpreter's 0.05 s)
    assert parent_and_cpu(zygote)[1] > 2.0

    os.kill(servers[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{servers[0]}").exists():  # reaped by the zygote: no zombie left
        assert time.monotonic() < deadline, Path(f"/proc/{servers[0]}/stat").read_text()
        time.sleep(0.05)
    for i in range(2):  # the dead one's place is taken by a new server, forked from the same zygote
        proc = warm_cli.run_warm([tmp_path / f"again-{i}", 0], warm_cli.cli_env(), 300, script=script, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        server = int((tmp_path / f"again-{i}").read_text())
        assert server != servers[0] and parent_and_cpu(server)[0] == zygote


def test_variables_set_in_the_test_process_after_it_started_do_not_reach_the_runs(monkeypatch):
    """vLLM, run in a test's own process, sets VLLM_DIST_IDENT anew for each engine (and a dozen more): each change
    made another environment, so another warm server, and reached runs that never asked for it."""
    monkeypatch.setenv("VLLM_DIST_IDENT", "vllm_dist_0123")
    env = warm_cli.cli_env()
    assert "VLLM_DIST_IDENT" not in env and env["PATH"] == os.environ["PATH"] and env["OMP_NUM_THREADS"] == "1"


def test_runs_find_the_repository_first_and_keep_the_pythonpath_the_tests_started_with(monkeypatch):
    """A GPU machine without network has megatron-core or vLLM unpacked into a folder on PYTHONPATH: the actor
    reference of the engine contract, run with the repository as the whole PYTHONPATH, lost megatron-core."""
    monkeypatch.setitem(warm_cli.START_ENVIRON, "PYTHONPATH", "/opt/carried")
    assert warm_cli.cli_env()["PYTHONPATH"] == f"{warm_cli.REPO}{os.pathsep}/opt/carried"
    monkeypatch.delitem(warm_cli.START_ENVIRON, "PYTHONPATH")
    assert warm_cli.cli_env()["PYTHONPATH"] == str(warm_cli.REPO)


MEDIA_PROBE = """import sys, time
from pathlib import Path
from wandb.sdk.data_types._private import MEDIA_TMP
Path(sys.argv[1]).write_text(MEDIA_TMP.name)
time.sleep(float(sys.argv[2]))
"""


def test_runs_at_once_have_wandb_media_folders_of_their_own(tmp_path):
    """wandb deletes its media folder when its process exits: a shared one was deleted under a live run (a suite run:
    the run refused by the run lock took the live run's folder with it)."""
    script = tmp_path / "media_of.py"
    script.write_text(MEDIA_PROBE)
    files = [tmp_path / "media-0", tmp_path / "media-1"]
    runs = [warm_cli.start_warm([f, 600], warm_cli.cli_env(), 300, script=script, cwd=tmp_path) for f in files]
    try:
        folders = written_by(runs, files)
    finally:
        for run in runs:
            run.kill()
            run.wait(timeout=60)
    assert folders[0] != folders[1]
