"""Warm CLI runs for the tests: `python -m dapo_mcore.cli ARGS` (or a tool script) without paying the imports
every time.

A short training run of the CLI spends about 7 of its 10 s importing torch, Megatron-Core and transformers
(tests/README.md). A zygote process (`python -m tests.warm_cli FD`) imports them once per environment and then
forks the servers, and a server forks one fresh process per run. That child becomes the command: `dapo_mcore.cli`
executed as `__main__` (as `python -m` does), its own argv, environment, working directory, stdin (/dev/null),
stdout and stderr (files the client reads), a process group of its own, and the interpreter's exit up to its
teardown (`exit_as_python_would`: non-daemon threads joined, atexit handlers run, the exit code python gives). Only the
imports are shared, and neither the zygote nor a server runs anything of torch before forking (no thread pool to
inherit).

`run_warm` waits for its run; `start_warm` returns at once with a WarmProcess that tests signal, kill and wait
for as they would a Popen. A server runs one command at a time: a run started while its server is busy goes to
another server for the same environment (started on first need). Only the first server of an environment costs
the imports (about 13 CPU-s): the zygote is started then, and every server, the first one too, is a fork of it.
The test process holds one end of a socket pair per server and hands the other end to the zygote (SCM_RIGHTS over
the zygote's control socket, inherited at its start): no socket path to name, clean up or share, and the zygote
forks one server per socket it receives, which serves it as a line protocol (a JSON request in, {"pid"} and then
{"returncode", "timed_out"} out). The zygote and each server die with their parent (PR_SET_PDEATHSIG: the zygote
with the test process, a server with the zygote); the zygote reaps the servers, and a server whose connection
ends (EOF: the test process is gone, or dropped it) exits. A dead server is replaced, a dead zygote too.

Several ranks (`ranks=N`): the forked child becomes a launcher that forks the N ranks, each with the variables
of an env:// rendezvous (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as srun's tasks
get them in slurm/train.sbatch: rank 0 hosts the store. Their output goes to the same two files, as torchrun's
workers share its pipes; when a rank fails the launcher ends the others (SIGTERM, SIGKILL 30 s later) and exits
with the failed rank's code. This replaces torchrun where it is only the tests' way to start N ranks on one host:
each rank saves the 10-12 CPU-s of a fresh interpreter's imports (the suite is CPU-bound on 2 cores). What is about
torchrun itself (a dead rank named, preflight printed once, its rendezvous across hosts) runs real torchrun.

What is not run warm: runs under a real torchrun (its workers start their own interpreters), the test that is about
the command's own start and exit, and a run whose environment differs from the zygote's (a new zygote is started
for that environment, since variables are read at import time). On a machine with a GPU nothing is: the preloaded
imports initialise CUDA there, and torch refuses CUDA in a forked child ("Cannot re-initialize CUDA in forked
subprocess", seen on an H200), so each run is a fresh `python` (`cold_process`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What every training run imports before its first step, and what it imports later (the curves' pyplot, the HF
# model classes, wandb's API): those took 1.7 of a warm 3-step demo run's 5.5 CPU-s. Engines' packages (vLLM)
# are imported by the runs that use them.
PRELOAD = (
    "torch",
    "megatron.core",
    "transformers",
    "dapo_mcore.trainer",
    "matplotlib.pyplot",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "wandb.apis.public",
)


# ---- the zygote and its servers (python -m tests.warm_cli FD) ------------------------------------------------
def die_with_parent() -> None:
    """SIGKILL when the parent ends, however it ends (PR_SET_PDEATHSIG; a fork does not inherit it, so the runs
    do not get it). A parent that ended before the call is not waited for."""
    import ctypes

    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent or parent == 1:  # 1: the parent had ended before the first getppid (seen once)
        os._exit(1)


def serve() -> None:
    """The zygote: the imports, then a server forked for each socket the test process sends on the control socket
    (file descriptor argv[1]); it ends when the test process does (its end of the control socket closed)."""
    die_with_parent()
    preload()
    # Not gc.freeze() here (measured on warm 3-step demo runs, medians of 5 and of 10): left frozen, the heap is not
    # freed at a run's exit (7.2 CPU-s a run, 9.7 without) but triton's nanobind then reports its objects on stderr
    # as leaked; unfrozen at the exit (atexit), to be freed as in a fresh process, 11.3 CPU-s against 11.2.
    control = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGCHLD, reap_servers)  # a server's exit interrupts the wait for the next socket
    control.sendall(b"ready\n")
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1, 1)
        if not message:  # the test process is gone
            server_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server waits for its runs itself
            serve_connection(socket.socket(fileno=fds[0]))  # never returns
        os.close(fds[0])


def preload() -> None:
    import importlib

    importlib.import_module("matplotlib").use("Agg")  # before pyplot, as dapo_mcore.utils.plot does
    for name in PRELOAD:
        importlib.import_module(name)


def reap_servers(_signum, _frame) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def serve_connection(connection: socket.socket) -> None:
    """A server: one run at a time for the requests on `connection`, until the test process closes it."""
    die_with_parent()
    requests = connection.makefile("r")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the run does not hold the connection: the client sees the server's end as its EOF
            requests.close()
            connection.close()
            become_the_run(request)  # exits with the command's code: never returns here
        send(connection, {"pid": pid})
        returncode, timed_out = wait_for(pid, request["timeout"])
        if request.get("ranks"):  # what a rank left behind (an engine's or verifier's worker) ends with the launch
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        send(connection, {"returncode": returncode, "timed_out": timed_out})
    server_exit()


def send(connection: socket.socket, reply: dict) -> None:
    try:
        connection.sendall(json.dumps(reply).encode() + b"\n")
    except ConnectionError:  # the test process dropped the connection
        server_exit()


def server_exit() -> None:
    # No atexit handlers: they are the imports' (wandb's deletes the media folder that other servers' runs use), and
    # the interpreter's teardown would only free the heap that the other servers share.
    os._exit(0)


def become_the_run(request: dict) -> None:
    os.setsid()  # a group of its own: a timeout ends the run's workers too (and every rank of a launch)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    appended = os.O_WRONLY | os.O_CREAT | os.O_APPEND  # several ranks write to the same files
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], appended),
                            (2, request["stderr"], appended)):  # fmt: skip
        target = os.open(path, flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if request.get("ranks"):
        os._exit(launch_ranks(request))
    run_command(request)


def own_wandb_media_folder() -> None:
    """wandb makes its media folder (tables) when imported, and deletes it when its process exits. Megatron-Core
    imports wandb, so every run forked from a zygote would write to the zygote's folder, and the first run to exit
    would delete it under the others (a suite run: a refused run's exit failed the live run's next table). Each run
    and rank gets a folder of its own (every wandb media type reads MEDIA_TMP.name; its exit deletes that one)."""
    wandb_media = sys.modules.get("wandb.sdk.data_types._private")
    if wandb_media is not None:
        wandb_media.MEDIA_TMP.name = tempfile.mkdtemp("wandb-media")


def run_module_or_script(request: dict) -> None:
    script = request.get("script")
    if script:  # python SCRIPT ARGS: the script's folder first on sys.path, as python puts it
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = ["dapo_mcore.cli", *request["argv"]]
        runpy.run_module("dapo_mcore.cli", run_name="__main__", alter_sys=True)


def run_command(request: dict) -> None:
    """The request's command in this process, which then exits as python would (never returns)."""
    own_wandb_media_folder()
    try:
        run_module_or_script(request)
        code = 0  # it ran to its end without calling sys.exit
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException as error:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1  # python ends by SIGINT then
    exit_as_python_would(code)


def exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)  # sys.exit("message"): the message, and 1
    return 1


def exit_as_python_would(code: int) -> None:
    """What the interpreter does at its exit, up to its teardown: join the non-daemon threads, run the atexit
    handlers, flush the streams. The teardown (every module and object freed) is left out: in a fork it only frees
    the heap shared with the zygote, writing to each of its pages and so copying them: 2.5 of the 7.5 CPU-s of a
    3-step demo run that saves each step (measured: 7.0-8.7 CPU-s with it, 4.4-5.8 without, 8 runs each)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# What a rank's process group is sent by the launcher when another rank failed, and how long it has to end (torchrun's)
RANK_STOP_GRACE_S = 30.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def rank_environment(rank: int, world: int) -> dict[str, str]:
    """An env:// rendezvous on this host, rank 0 hosting the store (MASTER_PORT is the caller's)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1"}  # fmt: skip


def launch_ranks(request: dict) -> int:
    """Fork the request's ranks (this process has run nothing of torch), then wait for them as torchrun would:
    the first rank that fails ends the others, and its exit code is the launch's (128 + N for signal N)."""
    world = request["ranks"]
    ranks: dict[int, int] = {}  # pid -> rank
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.environ.update(rank_environment(rank, world))
            run_command(request)  # exits with the rank's code: never returns here
        ranks[pid] = rank

    def forward(signum, _frame):  # a signal to the launch is one to every rank, as torchrun passes SIGTERM on
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    return wait_for_ranks(ranks)


def wait_for_ranks(ranks: dict[int, int]) -> int:
    left, launch_code, kill_at = dict(ranks), 0, None
    while left:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for other in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
                kill_at = None
            time.sleep(0.05)
            continue
        if pid not in left:
            continue
        rank, code = left.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0 and launch_code == 0:
            launch_code = code if code > 0 else 128 - code
            print(f"warm launch: rank {rank} ended with exit code {code}; ending the other ranks", file=sys.stderr)
            for other in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGTERM)
            kill_at = time.monotonic() + RANK_STOP_GRACE_S
    return launch_code


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
class Zygote:
    """The process that imports PRELOAD for one environment and forks its servers."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.control, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen([sys.executable, "-m", "tests.warm_cli", str(theirs.fileno())], cwd=cwd,
                                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            pass_fds=(theirs.fileno(),))  # fmt: skip
        with contextlib.suppress(EOFError, ConnectionError):
            if read_line(self.control.fileno(), bytearray(), timeout=None) == "ready":
                return
        raise RuntimeError(f"the warm CLI zygote did not start (exit code {self.process.wait()})")

    def fork_server(self) -> socket.socket:
        """A new server's connection: its other end goes to the zygote, which forks the server to serve it."""
        ours, theirs = socket.socketpair()
        with theirs:
            socket.send_fds(self.control, [b"s"], [theirs.fileno()])
        return ours


def read_line(fd: int, unread: bytearray, timeout: float | None) -> str | None:
    """The next line on `fd` (after what is in `unread`, which keeps what follows it), or None when none comes
    within `timeout` seconds. Read from the socket itself (no buffered reader): select then tells truly whether a
    line is on its way."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in unread:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            raise EOFError
        unread += chunk
    line, _, rest = bytes(unread).partition(b"\n")
    unread[:] = rest
    return line.decode()


_zygotes: dict[tuple, Zygote] = {}  # per environment


class WarmCli:
    """One server for one environment, running one command at a time: forked from the environment's zygote (the
    zygote is started first when there is none, or it died)."""

    def __init__(self, env: dict[str, str], cwd: Path):
        key = tuple(sorted(env.items()))
        zygote = _zygotes.get(key)
        if zygote is None or zygote.process.poll() is not None:
            zygote = _zygotes[key] = Zygote(env, cwd)
        self.zygote, self.connection, self._unread = zygote, zygote.fork_server(), bytearray()

    def alive(self) -> bool:
        """False once the server has ended: its end of the connection closed (no run holds it)."""
        if not select.select([self.connection], [], [], 0)[0]:
            return True
        with contextlib.suppress(ConnectionError):
            return self.connection.recv(1, socket.MSG_PEEK) != b""
        return False

    def reply(self, timeout: float | None) -> str | None:
        """The server's next line, or None when none comes within `timeout` seconds."""
        try:
            return read_line(self.connection.fileno(), self._unread, timeout)
        except (EOFError, ConnectionError):
            code = self.zygote.process.poll()
            zygote = "" if code is None else f" (its zygote too: exit code {code})"
            raise RuntimeError(f"the warm CLI server ended{zygote}") from None

    def start(self, argv: list[str], cwd: Path, timeout: float, env: dict[str, str], script=None,
              ranks: int = 0) -> WarmProcess:  # fmt: skip
        out_dir = Path(tempfile.mkdtemp(prefix="warm-run-"))  # the run's stdout and stderr files
        request = dict(argv=argv, cwd=str(cwd), env=env, timeout=timeout, script=str(script) if script else None,
                       stdout=str(out_dir / "stdout"), stderr=str(out_dir / "stderr"), ranks=ranks)  # fmt: skip
        with contextlib.suppress(ConnectionError):  # the server is gone: reply says so
            self.connection.sendall((json.dumps(request) + "\n").encode())
        pid = json.loads(self.reply(timeout=None))["pid"]
        proc = WarmProcess(self, command(argv, script, ranks, env), pid, out_dir)
        _running.add(proc)
        return proc


class WarmProcess:
    """A command running in a process forked from a warm server, used as a subprocess.Popen(text=True) with
    stdout and stderr piped is: pid, poll(), wait(), send_signal(), kill(), communicate(), returncode. The exit
    code is reported by the server (its parent): -N for a signal, as Popen's."""

    def __init__(self, server: WarmCli, args: list[str], pid: int, out_dir: Path):
        self.args, self.pid, self.returncode, self.timed_out = args, pid, None, False
        self._server, self._out_dir, self._output = server, out_dir, ("", "")

    def poll(self) -> int | None:
        if self.returncode is None:
            self._collect(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._collect(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._output

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _collect(self, timeout: float | None) -> bool:
        line = self._server.reply(timeout)
        if line is None:
            return False
        reply = json.loads(line)
        self.returncode, self.timed_out = reply["returncode"], reply["timed_out"]
        _running.discard(self)
        self._output = tuple((self._out_dir / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        shutil.rmtree(self._out_dir, ignore_errors=True)
        return True


_running: set[WarmProcess] = set()  # started and not waited for: their servers are busy


def end_leftover_runs() -> None:
    """Kill what a test started and did not wait for (it failed before): the run's whole process group, so that
    it does not train on beside the next tests, and its server is free again."""
    for proc in list(_running):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


_servers: dict[tuple, list[WarmCli]] = {}  # per environment (few: the CLI's and the torchrun workers')


# The test process's environment as it started (tests/conftest.py imports this module first). What tests run in
# their own process sets variables in os.environ as it goes: vLLM a dozen (VLLM_DIST_IDENT, new for each engine;
# LD_PRELOAD), Transformer Engine its NVTE_* choices, torch's inductor its cache folder. Passed on, they made each
# later run's environment another one (a new server: about 13 CPU-s; 5 in a suite's first 15 minutes) and reached runs
# that never asked for them.
START_ENVIRON = dict(os.environ)


def cli_env() -> dict[str, str]:
    """The environment of the tests' CLI runs: the test process's as it started, one thread each (runs share the 2
    cores), no warnings, the repository importable (the dist tier's scripts import tests.*): one environment, so one
    set of warm servers, for the CLI's runs and the scripts' (its zygote costs about 13 CPU-s to start; its servers
    are forks)."""
    return {**START_ENVIRON, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": repo_first_on_path(START_ENVIRON)}  # fmt: skip


def repo_first_on_path(environ: dict[str, str]) -> str:
    """PYTHONPATH for a test's child process: the repository, then what `environ` had there (a GPU machine without
    network has megatron-core or vLLM unpacked into a folder on it; replacing it lost them)."""
    return os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))


# Set per call (by pytest for each test phase, or a one-process world's rendezvous); the child gets the caller's
# values, and no import reads them.
PER_CALL_VARIABLES = ("PYTEST_CURRENT_TEST", "MASTER_PORT")


def forking_is_unsafe() -> bool:
    """A visible GPU: a fork after the server's imports cannot use CUDA (torch.cuda.is_available asks the driver
    without initialising CUDA in this process)."""
    import torch

    return torch.cuda.is_available()


def command(argv: list, script=None, ranks: int = 0, env: dict | None = None) -> list[str]:
    """The command line a run stands for: with `ranks`, torchrun's on one host, at env's MASTER_PORT."""
    launcher = []
    if ranks:
        port = (env or {}).get("MASTER_PORT", "29500")
        launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                    f"--master_port={port}"]  # fmt: skip
    target = [str(script)] if script else ["-m", "dapo_mcore.cli"]
    return [sys.executable, *launcher, *target, *map(str, argv)]


def cold_process(argv: list, env: dict[str, str], script=None, cwd: Path = REPO, ranks: int = 0) -> subprocess.Popen:
    """The command in a fresh interpreter, in a process group of its own, as a warm run would be."""
    pipe = subprocess.PIPE
    return subprocess.Popen(command(argv, script, ranks, env), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=pipe, stderr=pipe, text=True, start_new_session=True)  # fmt: skip


def start_warm(argv: list, env: dict[str, str], timeout: float, script=None, cwd: Path = REPO, ranks: int = 0):
    """`python -m dapo_mcore.cli ARGV` (or `python SCRIPT ARGV`) started in a process forked from an idle warm
    server for `env` (one is started when none is idle); the server ends the run after `timeout` seconds. With
    `ranks`, that many ranks of an env:// rendezvous on env's MASTER_PORT, as `torchrun --nproc_per_node` starts.
    On a GPU machine a fresh process instead (forking_is_unsafe; torchrun for ranks), which the caller waits for
    with its timeout."""
    if forking_is_unsafe():
        return cold_process(argv, env, script, cwd, ranks)
    server_env = {k: v for k, v in env.items() if k not in PER_CALL_VARIABLES}
    servers = _servers.setdefault(tuple(sorted(server_env.items())), [])
    busy = {proc._server for proc in _running}
    for dead in [s for s in servers if not s.alive()]:  # a dead server is replaced
        servers.remove(dead)
        if dead not in busy:  # a run still waited for reads its connection to the end (its server ended)
            dead.connection.close()
    server = next((s for s in servers if s not in busy), None)
    if server is None:
        server = WarmCli(server_env, REPO)  # each run goes to its own cwd
        servers.append(server)
    return server.start([str(a) for a in argv], cwd, timeout, env, script, ranks)


def run_warm(argv: list, env: dict[str, str], timeout: float, script=None, cwd: Path = REPO, ranks: int = 0):
    """start_warm's command, waited for: returns what subprocess.run(capture_output=True, text=True) would."""
    if forking_is_unsafe():
        return subprocess.run(command(argv, script, ranks, env), capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd)  # fmt: skip
    proc = start_warm(argv, env, timeout, script, cwd, ranks)
    out, err = proc.communicate()
    if proc.timed_out:
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


if __name__ == "__main__":
    serve()
