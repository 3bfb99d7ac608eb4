"""A private Slurm cluster for the slurm test tier: munged + slurmctld + slurmd on localhost (one node), or, with
`nodes=N`, N nodes on this machine, each a network namespace with its own address, hostname and slurmd
(tests/slurm/netns.py), all seeing this machine's file system as a cluster's nodes see their shared storage."""

# How this Slurm (Debian 12 slurm-wlm 22.05.8, 2 cores) behaves, measured with throwaway batch scripts on the
# configuration below (KillWait=30, OverTimeLimit=0) unless a line says otherwise:
#
# Timer resolution. slurmctld checks time limits and --signal warnings in one loop every 30 s (PERIODIC_TIMEOUT,
#   a compile-time constant: no slurm.conf setting changes it). The ticks fall at slurmctld start + 30 s * k.
# a. --signal=B:USR1@W goes out at the first tick where the time left is <= W + 30 s: 0-30 s EARLY, never late.
#   --time=1 --signal=B:USR1@30 (W + 30 >= the limit, so the first tick after the start): USR1 came 0.3, 7, 11, 24,
#   26, 27, 27, 30 s after the start. --time=2 @60: at +56 s (64 s before the limit); --time=2 @50: at +57 s (63 s
#   before). A bash trap runs within ~10 ms when the script sits in `wait` (`cmd & wait $!`, looped while the
#   child lives). B: signals the batch shell only (its background `sleep` was not signalled); without B: every
#   process of each srun step gets it (a task's `sleep` child died of USR1) and the batch shell does not.
#   The signal is sent again in each run of a requeued job.
# b. `scontrol requeue $SLURM_JOB_ID` in the trap returns 0 in ~10 ms; the batch shell gets SIGTERM ~10 ms later
#   ("*** JOB n ON localhost CANCELLED AT ... DUE TO JOB REQUEUE ***" in the output) and SIGKILL KillWait later if
#   anything survives. Same job id; the next run has SLURM_RESTART_COUNT=1 (unset in the first run), 2 after a
#   second requeue, and `Restarts=` the same. SubmitTime becomes the requeue time; StartTime/RunTime are the
#   latest run's. Requeue sets the begin time to now + cred_expire + 1 s (AuthInfo=cred_expire, default 120 so
#   121 s; minimum 5): EligibleTime = requeue + 11 s with cred_expire=10 here. The job then starts at the next
#   scheduling pass: with the defaults (sched_interval=60, bf_interval=30) 2 s and 18 s after EligibleTime
#   (requeue -> next run 123 s with the default cred_expire, 29 s with 10); with SchedulerParameters=
#   sched_interval=2,bf_interval=2 (set here) requeue -> next run took 11.0 s (cred_expire=10) and 6.2 s (=5).
#   If a process ignores the SIGTERM the job stays COMPLETING until the SIGKILL (30 s later) and the requeue and
#   its begin-time delay only count from then. While any job is COMPLETING the node starts no job at all (an
#   eligible job waited 23 s for another job's KillWait to end).
#   Output file: the default open mode truncates it at each run (only the last run's lines remained);
#   --open-mode=append keeps every run's lines (with the CANCELLED ... DUE TO JOB REQUEUE line).
# c. Time limit: the job is ended at the first tick after StartTime + limit: 0-28 s late (a 1 min limit ended at
#   +60, +67, +71, +84, +86, +87 s; 2 min at +146, +148). The batch shell gets SIGCONT then SIGTERM ("CANCELLED AT
#   ... DUE TO TIME LIMIT"), every process of every step SIGTERM at the same moment (a task saw two: slurmstepd's
#   and srun's "forcing job termination"), then SIGKILL KillWait after: TERM-ignoring loops were last alive 29.3-
#   29.5 s after the TERM. Record: JobState=TIMEOUT Reason=TimeLimit, RunTime the real one (00:01:27 for a 1 min
#   limit), ExitCode 0:0 when the script exited by itself after the TERM, 0:9 when it was SIGKILLed.
# No accounting here (no sacct): `scontrol show job` keeps finished jobs for MinJobAge (set to a day).

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.slurm.netns import CONTROLLER, NetworkUnavailable, NodeNetwork

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# Taken by every process that installs Slurm: the suite's workers start the one-node and the multi-node clusters at
# once, and a second apt-get found dpkg's lock held, failed, and its tests were skipped with the suite green.
INSTALL_LOCK = Path(tempfile.gettempdir()) / "dapo-mcore-slurm-install.lock"
NODE = "localhost"
# Job states after which a job will not run again (PENDING, RUNNING, COMPLETING, REQUEUED... are not final).
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "SPECIAL_EXIT",
    }
)
# A cluster that binds each task to cores, as many sites' do (task/affinity, binding to cores by default): Slurm 22.05
# then gives a step's task one core unless srun is told --cpus-per-task (measured: a job of -n 1 -c 2 on a node of
# 2 CPUs, `srun nproc` said 1; with SRUN_CPUS_PER_TASK=2, 2). Binding needs each node's CPUs to be real ones: a
# node declaring more CPUs than this machine has is bound within the real ones (Slurm resets cpus_per_task to 1).
CORE_BINDING = "TaskPlugin=task/affinity\nTaskPluginParam=autobind=cores"
# `env` (so every daemon, slurmstepd and job submitted with it) carries this: stop() uses it to find what the
# cluster left behind, without matching other processes by name.
MARKER = "DAPO_TEST_SLURM_CLUSTER"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why (the fixture skips with it)."""


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in SBIN_DIRS:
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"  ({path}: {exc})"
    return "\n".join(f"  {line}" for line in text[-lines:]) or "  (empty)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def parse_record(line: str) -> dict[str, str]:
    """`scontrol show job -o` output (Key=Value separated by spaces; values may hold spaces) as a dict."""
    keys = list(re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=", line.strip()))
    text = line.strip()
    record = {}
    for i, match in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(text)
        record[match.group(1)] = text[match.end() : end].strip()
    return record


def seconds(duration: str) -> int:
    """A Slurm duration ([D-]HH:MM:SS, MM:SS) in seconds."""
    days, _, clock = duration.rpartition("-")
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return total + int(days or 0) * 86400


class SlurmCluster:
    """munged, slurmctld and slurmd on this machine with a private slurm.conf, state, logs, key and ports.

    Every client call must use `env` (it sets SLURM_CONF and drops any SLURM_* of an enclosing job) and, on a
    multi-node cluster, run in the controller's network (`client`): `run` and `submit` do both.

    nodes=0: one node, `localhost`. nodes=N: node1..nodeN, each in its own namespaces with its own slurmd;
    slurmctld runs in the controller's namespace (hostname `ctl`), munged on this machine (its socket is a file).
    `read_only_on` maps a node to paths that are read-only on that node alone; `slurmd_timeout` is the seconds
    slurmctld waits for a silent node before it marks it DOWN (and fails and re-queues its jobs). `task_plugin`:
    its slurm.conf lines (CORE_BINDING: tasks bound to their CPUs, as many sites bind them).
    """

    def __init__(
        self,
        *,
        cpus: int | None = None,
        kill_wait: int = 30,
        cred_expire: int = 10,
        scheduler_parameters: str = "sched_interval=2,bf_interval=2",
        min_job_age: int = 86400,
        extra_conf: str = "",
        start_timeout: float = 60.0,
        nodes: int = 0,
        read_only_on: dict[str, list[Path]] | None = None,
        slurmd_timeout: int = 300,
        task_plugin: str = "TaskPlugin=task/none",
    ):
        self.cpus = cpus or max(2, os.cpu_count() or 1)
        self.kill_wait = kill_wait
        # Also the delay before a requeued job may run again (cred_expire + 1 s): the Slurm default is 120.
        self.cred_expire = cred_expire
        # A full scheduling pass every 2 s (default 60) and backfill every 2 s (default 30): an eligible job starts
        # within ~2 s instead of up to a minute later.
        self.scheduler_parameters = scheduler_parameters
        self.min_job_age = min_job_age
        self.extra_conf = extra_conf
        self.start_timeout = start_timeout
        self.network = NodeNetwork(nodes) if nodes else None
        self.nodes = self.network.nodes if self.network else [NODE]
        self.read_only_on = read_only_on or {}
        self.slurmd_timeout = slurmd_timeout
        self.task_plugin = task_plugin
        self.root: Path | None = None
        self.conf: Path | None = None
        self.env: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._started = False

    # ---------------------------------------------------------------- installing

    @staticmethod
    def missing() -> list[str]:
        return [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]

    @classmethod
    def ensure_installed(cls, timeout: float = 900.0) -> None:
        """Install slurm-wlm and munge with apt-get (as root) when a binary is missing; SlurmUnavailable if not.
        One process at a time (INSTALL_LOCK): the others wait, then find it installed."""
        if not cls.missing():
            return
        with open(INSTALL_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            cls._install(timeout)

    @classmethod
    def _install(cls, timeout: float) -> None:
        missing = cls.missing()
        if not missing:  # another process installed it while this one waited for the lock
            return
        if os.geteuid() != 0:
            raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} missing) and we are not root")
        if _which("apt-get") is None:
            raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} missing) and there is no apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        # Keep the packages' maintainer scripts from starting the system's own daemons (as Docker images do).
        policy = Path("/usr/sbin/policy-rc.d")
        made_policy = False
        if not policy.exists():
            with contextlib.suppress(OSError):
                policy.write_text("#!/bin/sh\nexit 101\n")
                policy.chmod(0o755)
                made_policy = True
        try:
            proc = subprocess.run(
                # another apt (the system's own) may hold dpkg's lock: wait for it rather than fail
                [
                    "bash",
                    "-c",
                    "apt-get -o DPkg::Lock::Timeout=300 update && apt-get -o DPkg::Lock::Timeout=300 "
                    "install -y --no-install-recommends slurm-wlm munge",
                ],  # fmt: skip
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"apt-get install slurm-wlm munge took over {timeout:.0f} s") from None
        finally:
            if made_policy:
                policy.unlink(missing_ok=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise SlurmUnavailable(f"apt-get install slurm-wlm munge failed ({proc.returncode}): {' | '.join(tail)}")
        missing = cls.missing()
        if missing:
            raise SlurmUnavailable(f"after apt-get install, still missing: {', '.join(missing)}")

    # ---------------------------------------------------------------- starting

    def start(self, workdir: str | os.PathLike) -> SlurmCluster:
        """Write a private configuration under a new folder in `workdir`, start the daemons, wait for an idle node.

        Raises SlurmUnavailable (with the daemons' log tails) when the node is not idle within start_timeout;
        whatever was started is stopped again first.
        """
        if self._started:
            raise RuntimeError("this SlurmCluster is already started")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test Slurm cluster runs its daemons as root; not root here")
        missing = self.missing()
        if missing:
            raise SlurmUnavailable(f"Slurm is not installed: {', '.join(missing)} missing")
        Path(workdir).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="slurm-", dir=workdir)).resolve()
        self._started = True
        atexit.register(self.stop)
        try:
            if self.network is not None:
                try:
                    self.network.create(self.root / "hosts")
                except NetworkUnavailable as exc:
                    raise SlurmUnavailable(f"no network namespaces for {len(self.nodes)} nodes: {exc}") from None
            self._write_files()
            self._start_daemons()
            self._wait_idle()
        except BaseException:
            self.stop(remove=False)
            raise
        return self

    def _write_files(self) -> None:
        root = self.root
        assert root is not None
        root.chmod(0o755)
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (root / sub).mkdir()
        (root / "munge").chmod(0o711)
        self.munge_socket = root / "munge" / "munge.socket"
        if len(str(self.munge_socket)) > 100:
            raise SlurmUnavailable(f"path too long for a unix socket: {self.munge_socket}")
        key = root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        (root / "plugstack.conf").write_text("")
        self.conf = root / "slurm.conf"
        if self.network is None:
            self.ctld_port, self.slurmd_port = _free_port(), _free_port()
            while self.slurmd_port == self.ctld_port:
                self.slurmd_port = _free_port()
        else:  # namespaces of its own: Slurm's standard ports are free there
            self.ctld_port, self.slurmd_port = 6817, 6818
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=dapotest",
                    f"SlurmctldHost={self._controller()}",
                    f"SlurmctldPort={self.ctld_port}",
                    f"SlurmdPort={self.slurmd_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool' / '%n'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    f"PlugStackConfig={root / 'plugstack.conf'}",
                    "MailProg=/bin/true",
                    "ProctrackType=proctrack/linuxproc",
                    *self.task_plugin.split("\n"),
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    # Trust the CPUs below even on a machine with fewer (one with 1 core still runs 2 tasks).
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    f"KillWait={self.kill_wait}",
                    f"MinJobAge={self.min_job_age}",
                    "OverTimeLimit=0",
                    f"SchedulerParameters={self.scheduler_parameters}",
                    "InactiveLimit=0",
                    f"SlurmdTimeout={self.slurmd_timeout}",
                    self.extra_conf,
                    *(
                        f"NodeName={node} NodeAddr={self._address(node)} NodeHostname={node} CPUs={self.cpus} "
                        "RealMemory=1000 State=UNKNOWN"
                        for node in self.nodes
                    ),  # fmt: skip
                    f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env = {**base, "SLURM_CONF": str(self.conf), MARKER: str(self.root)}
        for node in self.nodes:
            (root / "spool" / node).mkdir()

    def _controller(self) -> str:
        """SlurmctldHost: slurmctld accepts only its own host's name (with the address to reach it)."""
        return NODE if self.network is None else f"{CONTROLLER}({self.network.address(CONTROLLER)})"

    def _address(self, node: str) -> str:
        return "127.0.0.1" if self.network is None else self.network.address(node)

    def client(self, argv: list[str]) -> list[str]:
        """A client command as run against this cluster (in the controller's network when it has one)."""
        argv = [_which(argv[0]) or argv[0], *argv[1:]]
        return argv if self.network is None else self.network.on_controller(argv)

    def _on(self, member: str, argv: list[str]) -> list[str]:
        if self.network is None:
            return argv
        return self.network.wrap(member, argv, self.read_only_on.get(member, []))

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.root is not None
        log = open(self.root / "log" / f"{name}.stdio", "ab")  # noqa: SIM115 - the daemon keeps it
        try:
            self._procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.root,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def _start_daemons(self) -> None:
        root = self.root
        assert root is not None and self.conf is not None
        self._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={root / 'munge' / 'munge.key'}",
                f"--log-file={root / 'log' / 'munged.log'}",
                f"--pid-file={root / 'munged.pid'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            ],
        )
        self._wait_for(lambda: self.munge_socket.exists(), 15, "munged to create its socket")
        self._spawn(
            "slurmctld", self._on(CONTROLLER, [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.conf)])
        )
        for node in self.nodes:
            self._spawn(
                f"slurmd-{node}", self._on(node, [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf)])
            )

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, proc in self._procs.items() if proc.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{', '.join(dead)} exited while waiting for {what}\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_tails()}")
            time.sleep(0.5)

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo shows it (idle, allocated, down*, drained, ...)."""
        proc = subprocess.run(
            self.client(["sinfo", "-h", "-N", "-o", "%N %T"]), env=self.env, capture_output=True, text=True, timeout=30
        )
        pairs = (line.split() for line in proc.stdout.splitlines()) if proc.returncode == 0 else ()
        return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}

    def _wait_idle(self) -> None:
        everywhere = dict.fromkeys(self.nodes, "idle")
        self._wait_for(lambda: self.node_states() == everywhere, self.start_timeout, "sinfo to show every node idle")

    def log_tails(self, lines: int = 30) -> str:
        if self.root is None:
            return ""
        logs = sorted((self.root / "log").glob("*"))
        return "\n".join(f"--- {path.name}:\n{_tail(path, lines)}" for path in logs)

    # ---------------------------------------------------------------- jobs

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command (scontrol, squeue, ...) against this cluster. A client killed by a signal is
        tried again, twice: once `scontrol show job` died of SIGPIPE (-13) while a job re-queued, its connection
        to slurmctld broken mid-reply, and failed a suite run."""
        for _ in range(3):
            proc = subprocess.run(
                self.client(list(argv)), env=self.env, capture_output=True, text=True, timeout=timeout
            )
            if proc.returncode >= 0:
                break
            time.sleep(1.0)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def submit(
        self,
        script: str | os.PathLike,
        *args: str,
        sbatch_options: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> int:
        """sbatch `script` (a file, or the text of a script when the string has a newline) with `args`; the job id.

        The job sees this process's environment plus `env` (sbatch exports everything by default). Without an
        --output option the output goes to <root>/jobs/slurm-<id>.out (the record's StdOut names it).
        """
        assert self.root is not None, "start() the cluster first"
        if isinstance(script, str) and "\n" in script:
            path = Path(tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.root / "jobs")[1])
            path.write_text(script)
            path.chmod(0o755)
        else:
            path = Path(script)
        options = list(sbatch_options)
        if not any(opt in ("-o", "--output") or opt.startswith(("-o", "--output=")) for opt in options):
            options.append(f"--output={self.root / 'jobs' / 'slurm-%j.out'}")
        proc = subprocess.run(
            self.client(["sbatch", "--parsable", *options, str(path), *args]),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd or self.root / "jobs",
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {path} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job's record from `scontrol show job -o` (JobState, ExitCode, Restarts, RunTime, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        if not out:
            raise RuntimeError(f"no record for job {job_id}")
        return parse_record(out.splitlines()[0])

    def wait(self, job_id: int, timeout: float = 120, states=FINAL_STATES, poll: float = 0.5) -> dict[str, str]:
        """Poll until the job's JobState is one of `states` (by default: final); its record then.

        TimeoutError (with the last record) when it does not get there within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            record = self.job(job_id)
            if record.get("JobState") in states:
                return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {record}")
            time.sleep(poll)

    # ---------------------------------------------------------------- stopping

    def _cancel_all(self, timeout: float) -> None:
        proc = self.run("squeue", "-h", "-o", "%A", check=False, timeout=15)
        ids = proc.stdout.split() if proc.returncode == 0 else []
        if not ids:
            return
        self.run("scancel", *ids, check=False, timeout=15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.run("squeue", "-h", "-o", "%A", check=False, timeout=15)
            if proc.returncode != 0 or not proc.stdout.split():
                return
            time.sleep(0.5)

    def _pid(self, name: str) -> int | None:
        if self.root is not None:
            with contextlib.suppress(OSError, ValueError):
                return int((self.root / f"{name}.pid").read_text().strip())
        proc = self._procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def _ours(self, pid: int) -> bool:
        if any(proc.pid == pid for proc in self._procs.values()):
            return True
        with contextlib.suppress(OSError):
            return f"{MARKER}={self.root}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return False

    def _stop_daemon(self, name: str, timeout: float = 15) -> None:
        pid = self._pid(name)
        proc = self._procs.get(name)
        # A stale pid file may name a pid reused by another process: signal only this cluster's.
        pids = {p for p in (pid, proc.pid if proc is not None else None) if p is not None and self._ours(p)}
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
            if proc is not None:
                proc.poll()
            time.sleep(0.2)
        for p in pids:
            if _pid_alive(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def leftover_pids(self) -> list[int]:
        """Processes started by this cluster's daemons (slurmstepd, job processes) that still run."""
        if self.root is None:
            return []
        needle = f"{MARKER}={self.root}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0") and _pid_alive(int(entry.name)):
                    found.append(int(entry.name))
        return found

    def stop(self, remove: bool = True) -> None:
        """Cancel the jobs, stop slurmd, slurmctld and munged (pid files), kill leftovers, remove the folder.

        Safe to call twice and after a start that failed midway. `remove=False` keeps the folder (logs).
        """
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(Exception):
                self._cancel_all(timeout=self.kill_wait + 15)
        for name in (*(f"slurmd-{node}" for node in self.nodes), "slurmctld", "munged"):
            self._stop_daemon(name)
        for _ in range(3):
            pids = self.leftover_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        self._procs.clear()
        if self.network is not None:
            self.network.destroy()  # and whatever still ran on a node
        if remove and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def fail_node(self, node: str) -> None:
        """`node` dies: its link goes down, then its slurmd and every process on it are killed (netns.fail)."""
        assert self.network is not None, "only a multi-node cluster has nodes that can fail"
        self.network.fail(node)
        proc = self._procs.get(f"slurmd-{node}")
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def processes_on(self, node: str) -> list[int]:
        return self.network.pids(node) if self.network is not None else []

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
