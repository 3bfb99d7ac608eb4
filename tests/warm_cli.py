"""Warm CLI runs for the tests: `python -m dapo_mcore.cli ARGS` (or a tool script) without paying the imports
every time.

A short training run of the CLI spends about 7 of its 10 s importing torch, Megatron-Core and transformers
(tests/README.md). A server process (`python -m tests.warm_cli`) imports them once and then forks one fresh
process per run. That child becomes the command: `dapo_mcore.cli` executed as `__main__` (as `python -m`
does), its own argv, environment, working directory, stdin (/dev/null), stdout and stderr (files the client
reads), a process group of its own, and the interpreter's normal exit (the CLI's SystemExit leaves the
server's loop: atexit handlers and non-daemon threads run as in any command). Only the imports are shared, and
the server runs nothing of torch before forking (no thread pool to inherit).

What is not run warm: runs under torchrun (its workers start their own interpreters), runs a test signals or
kills (they use their own Popen), and a run whose environment differs from the server's (a new server is
started for that environment, since variables are read at import time).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What every training run imports before its first step; the rest (engines, wandb) is imported by the child.
PRELOAD = ("torch", "megatron.core", "transformers", "dapo_mcore.trainer")


# ---- the server (python -m tests.warm_cli) ------------------------------------------------------------------
def serve() -> None:
    import ctypes
    import importlib

    # Ends with the test process that started it, however that ends (PR_SET_PDEATHSIG; not inherited by the runs).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    for name in PRELOAD:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    replies.write("ready\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            become_the_run(request)  # raises the command's SystemExit out of this loop: never returns here
        returncode, timed_out = wait_for(pid, request["timeout"])
        replies.write(json.dumps({"returncode": returncode, "timed_out": timed_out}) + "\n")


def become_the_run(request: dict) -> None:
    os.setsid()  # a group of its own: a timeout ends the run's workers too
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        target = os.open(path, flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    script = request.get("script")
    if script:  # python SCRIPT ARGS: the script's folder first on sys.path, as python puts it
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = ["dapo_mcore.cli", *request["argv"]]
        runpy.run_module("dapo_mcore.cli", run_name="__main__", alter_sys=True)
    sys.exit(0)  # it ran to its end without calling sys.exit: exit 0, as python would


def wait_for(pid: int, timeout: float) -> tuple[int, bool]:
    """The child's exit code as subprocess reports it (-N for signal N), and whether it was killed at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(0.02)


# ---- the client (the test process) ---------------------------------------------------------------------------
class WarmCli:
    """One server for one environment; `run` is subprocess.run(capture_output=True, text=True) for the CLI."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.server = subprocess.Popen([sys.executable, "-m", "tests.warm_cli"], cwd=cwd, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        if self.server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm CLI server did not start (exit code {self.server.wait()})")

    def run(self, argv: list[str], cwd: Path, timeout: float, out_dir: Path, env: dict[str, str], script=None):
        stdout, stderr = out_dir / "stdout", out_dir / "stderr"  # out_dir: a fresh folder per run
        request = dict(argv=argv, cwd=str(cwd), env=env, stdout=str(stdout), stderr=str(stderr), timeout=timeout)
        request["script"] = str(script) if script else None
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        reply = self.server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the warm CLI server ended (exit code {self.server.wait()})")
        reply = json.loads(reply)
        cmd = [sys.executable, *([str(script)] if script else ["-m", "dapo_mcore.cli"]), *argv]
        out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, out, err)
        return subprocess.CompletedProcess(cmd, reply["returncode"], out, err)


_servers: dict[tuple, WarmCli] = {}  # one per environment (few: the CLI's and the torchrun workers')


def cli_env() -> dict[str, str]:
    """The environment of the tests' CLI runs: one thread each (runs share the 2 cores), no warnings."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


# Set per call (by pytest for each test phase, or a one-process world's rendezvous); the child gets the caller's
# values, and no import reads them.
PER_CALL_VARIABLES = ("PYTEST_CURRENT_TEST", "MASTER_PORT")


def run_warm(argv: list[str], env: dict[str, str], timeout: float, script=None, cwd: Path = REPO):
    """`python -m dapo_mcore.cli ARGV` (or `python SCRIPT ARGV`) in a process forked from a warm server for
    `env` (started on first use, again if it died); returns what subprocess.run(capture_output=True) would."""
    server_env = {k: v for k, v in env.items() if k not in PER_CALL_VARIABLES}
    key = tuple(sorted(server_env.items()))
    server = _servers.get(key)
    if server is None or server.server.poll() is not None:
        server = _servers[key] = WarmCli(server_env, cwd)
    with tempfile.TemporaryDirectory(prefix="warm-run-") as out_dir:
        return server.run([str(a) for a in argv], cwd, timeout, Path(out_dir), env, script)


if __name__ == "__main__":
    serve()
