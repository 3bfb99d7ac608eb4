"""Slurm tasks forked from a warm server: the multi-node module's jobs start about 18 task processes, each a fresh
interpreter importing torch, Megatron-Core and transformers (about 12 CPU-s each, on 2 cores beside the suite).

slurm/train.sbatch starts each task as `$DAPO_PYTHON -m dapo_mcore.cli train ...`. Here DAPO_PYTHON is a small
client (`warm-python`, the standard library only: about 0.03 CPU-s) that hands the task to a server which imported
all that once (tests/warm_cli.py's PRELOAD). What it hands over: the command, its environment (SLURM_*, RANK, ...),
working directory, standard streams (slurmstepd's: the task's log) and namespaces (network, hostname, mounts: the
node's, tests/slurm/netns.py). The server forks a supervisor per task, which forks the run into all of these; so
the run reads what the task would: the node's address and hostname, its hosts file and read-only mounts, its
variables. The node's death kills it as it kills the task (it is in the node's network namespace).

The client stands for the run under Slurm: a signal sent to it (scancel, srun's) goes to the run's process group,
its exit code (or signal) is the run's, and its death (slurmstepd's SIGKILL, --kill-on-bad-exit) kills the run.
What differs from a cold task: the run is not slurmstepd's descendant, and its command line (ps) is the server's;
the client's names the task. The one-node Slurm module (test_train_jobs.py) keeps cold tasks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
NAMESPACES = (("net", 0x40000000), ("uts", 0x04000000), ("mnt", 0x00020000))  # CLONE_NEWNET, NEWUTS, NEWNS
MODULE = ["-m", "dapo_mcore.cli"]


# ---- the client (the task srun starts) -----------------------------------------------------------------------
def client(socket_path: str) -> None:
    """`warm-python -m dapo_mcore.cli ARGS`: the run, made by the server, stood for here until it ends."""
    if sys.argv[1:3] != MODULE:
        sys.exit(f"warm-python runs only `-m dapo_mcore.cli ...`, not {sys.argv[1:]}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError as exc:
        sys.exit(f"warm-python: the warm task server at {socket_path} is not there ({exc})")
    spaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name, _ in NAMESPACES]
    request = {"argv": sys.argv[3:], "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2, *spaces])
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: conn.sendall(f"{signum}\n".encode()))
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(64)  # a forwarded signal's handler runs, then recv goes on (PEP 475)
        if not chunk:
            sys.exit("warm-python: the warm task server ended before the run did")
        reply += chunk
    code = json.loads(reply)["returncode"]
    if code < 0:  # the run died of a signal: so does its stand-in, as srun should see it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def write_client(path, socket_path: str, repo: str) -> None:
    """The DAPO_PYTHON executable: this interpreter without site-packages (-S), running `client`."""
    path.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {repo!r})\n"
                    f"from tests.slurm.warm_tasks import client\nclient({socket_path!r})\n")  # fmt: skip
    path.chmod(0o755)


# ---- the server (python -m tests.slurm.warm_tasks SOCKET) -------------------------------------------------------
def serve(socket_path: str) -> None:
    from tests.warm_cli import die_with_parent, preload

    die_with_parent()  # with the test process that started it; the supervisors do not inherit it
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervisors are reaped by the kernel
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the supervisor waits for its run
            listener.close()
            supervise(conn)
            os._exit(0)
        conn.close()


def supervise(conn: socket.socket) -> None:
    """One task: fork its run, pass the client's signals on, report the run's exit; end the run if the client
    dies first."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3 + len(NAMESPACES))
    while not data.endswith(b"\n"):
        data += conn.recv(1 << 20)
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        conn.close()
        become_the_task(request, fds)  # exits with the command's code: never returns here
    for fd in fds:  # the run holds the task's streams now: srun sees their end when the run ends
        os.close(fd)
    code = wait_for_run(conn, pid)
    if code is not None:
        conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")


def wait_for_run(conn: socket.socket, pid: int) -> int | None:
    """The run's exit code (-N for signal N), or None when the client ended first (the run is killed then)."""
    import select

    pending = b""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            end_group(pid)  # what the run left behind, as the step's end does under Slurm
            return os.waitstatus_to_exitcode(status)
        if select.select([conn], [], [], 0.1)[0]:
            chunk = conn.recv(64)
            if not chunk:  # the client is gone (killed by slurmstepd, or its node died)
                end_group(pid)
                os.waitpid(pid, 0)
                return None
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                end_group(pid, int(line))


def end_group(pid: int, signum: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def become_the_task(request: dict, fds: list[int]) -> None:
    import ctypes

    from tests.warm_cli import run_command

    os.setsid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for fd, (name, nstype) in zip(fds[3:], NAMESPACES):
        if libc.setns(fd, nstype) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the task's {name} namespace")
        os.close(fd)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])  # after the mount namespace, which set it to that namespace's root
    os.environ.clear()
    os.environ.update(request["env"])
    run_command({"argv": request["argv"]})


if __name__ == "__main__":
    serve(sys.argv[1])
