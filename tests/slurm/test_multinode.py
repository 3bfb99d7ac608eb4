"""slurm/train.sbatch across hosts, on a private Slurm cluster of 9 nodes on this machine (each a network
namespace with its own address, hostname and slurmd: tests/slurm/netns.py). The reference: 2 tasks on one node
(DP 2) run the test recipe to the end. On 2 nodes x 1 task (the same DP 2, across the nodes), every job below
ends with the reference's metrics: torchrun across two hosts without Slurm; Slurm's time-limit
warning saves on both hosts, re-queues, and the job resumes on another node set; a warning that would come too
late, where the run stops by itself; a node that dies mid-step, which stops the ranks left within a bound, and
the re-queued job resumes from the newest save on other nodes. A problem of one host is named once, with that
host.

The jobs run at once, each on nodes of its own (--exclusive): the time-limited ones spend minutes waiting for
Slurm's timer, so `jobs` submits them and the reference when the module starts, and the tests wait for their
ends; the node failure, which a test must watch, goes first and runs beside them."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.slurm.cluster import SlurmCluster
from tests.slurm.conftest import CPUS_PER_NODE, READ_ONLY_NODE, SLURMD_TIMEOUT
from tests.slurm.jobs import (
    LATE_WARNING,
    OWN_STOP_MARGIN,
    OWN_STOP_STEP_PAUSE,
    STEPS,
    TIME_LIMIT,
    WARNED_STEP_PAUSE,
    WARNING_ONLY,
    job_output,
    rows,
    submit,
    without_timings,
)
from tests.slurm.warm_tasks import write_client

# Every job is DP 2 (the recipe's TP 1): 2 tasks. As cold processes each paid torch's and Megatron-Core's imports
# (about 12 CPU-s): at 4 tasks (TP 2 x DP 2) the module cost 955 CPU-s run by itself, 980 in a suite; at 2, 456. The
# tasks fork from a warm server (`warm_python`): 273 CPU-s and 4.0 minutes by itself (8.3 before).
CPU = ["--gpus-per-node=0", "--gres=none", "--exclusive"]  # a node holds one job
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", *CPU]
# task 0 on the first node, task 1 on the second, each with the node's 2 CPUs (tests/slurm/conftest.py)
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", f"--cpus-per-task={CPUS_PER_NODE}", *CPU]


def task_logs(tmp_path: Path, name: str, attempt: int = 0) -> dict[int, str]:
    """Each task's log of that attempt, by rank."""
    found = (tmp_path / "logs").glob(f"{name}-*/attempt-{attempt}-task-*.log")
    return {int(path.stem.rsplit("-", 1)[1]): path.read_text() for path in found}


def hosts_of(logs: dict[int, str]) -> dict[int, str]:
    """The host each task named in its log's first line (slurm/train.sbatch)."""
    hosts = {}
    for rank, text in logs.items():
        match = re.search(rf"task {rank} of \d+ on (\S+) \(local rank", text)
        assert match, text[:2000]
        hosts[rank] = match.group(1)
    return hosts


def attempts_nodes(out: str) -> list[str]:
    """The node list of each attempt, as the batch script logged it."""
    return re.findall(r"job \d+ attempt \d+ on (\S+) \(", out)


def expand(cluster, node_list: str) -> list[str]:
    """node[1-2] -> [node1, node2] (Slurm's own reading)."""
    return cluster.run("scontrol", "show", "hostnames", node_list).stdout.split()


def finished(cluster, job_id: int, tmp_path: Path, name: str, timeout: float = 600) -> tuple[dict, str]:
    record = cluster.wait(job_id, timeout=timeout)
    out = job_output(tmp_path, name, job_id)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out}"
    return record, out


@dataclass
class Job:
    """A job of this module: its id, run directory and folder (its output and task logs)."""

    id: int
    run_dir: Path
    folder: Path
    name: str

    def finished(self, cluster, timeout: float = 600) -> tuple[dict, str]:
        return finished(cluster, self.id, self.folder, self.name, timeout=timeout)


class Jobs(dict):
    """The jobs submitted when the module starts, by name; `reference()` waits for the one-node run."""

    cluster: SlurmCluster
    drained: str  # the node drained under the first attempt of "limited"

    def reference(self) -> Path:
        """The one-node run's directory, once it ended well."""
        one = self["one"]
        if not getattr(self, "_reference_checked", False):
            one.finished(self.cluster)
            assert len(set(hosts_of(task_logs(one.folder, "one")).values())) == 1
            self._reference_checked = True
        return one.run_dir


@pytest.fixture(scope="module")
def warm_python(slurm_nodes, tmp_path_factory) -> Iterator[str]:
    """The jobs' DAPO_PYTHON: a client handing each task to a server that imported torch, Megatron-Core and
    transformers once (tests/slurm/warm_tasks.py); the server carries the cluster's environment (its marker: the
    cluster's stop ends what is left of it)."""
    folder = Path(tempfile.mkdtemp(prefix="warm-tasks-"))  # short: a unix socket's path has at most 107 bytes
    socket_path = str(folder / "socket")
    env = {**slurm_nodes.env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # as the tasks have them
    server = subprocess.Popen([sys.executable, "-m", "tests.slurm.warm_tasks", socket_path], cwd=REPO, env=env,
                              stdout=subprocess.PIPE)  # fmt: skip
    try:
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the warm task server did not start (exit code {server.wait()})")
        write_client(folder / "warm-python", socket_path, str(REPO))
        yield str(folder / "warm-python")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def start(cluster, tmp_path_factory, name: str, *options: str, python: str, step_pause: float = 0.0, overrides=(),
          shape=TWO_NODES, env=None) -> Job:  # fmt: skip
    folder = tmp_path_factory.mktemp(name)
    job_id, run_dir = submit(cluster, folder, name, *options, step_pause=step_pause, overrides=overrides,
                             shape=shape, python=python, env=env)  # fmt: skip
    return Job(job_id, run_dir, folder, name)


# A re-queued attempt's time limit, in minutes: what the tests check happens in the first attempt, and on a loaded
# machine (when the jobs had 4 tasks, starting in 105-150 s beside the suite's heaviest tests) each later 5-minute
# attempt trained a step or two before its own warning (one job took 5 attempts), and a save of 42.8 s (estimated
# 10 s) ended 2 s before the limit, so that Slurm ended the job before its script could re-queue it.
RESUMED_TIME_LIMIT_MIN = 15


def lengthen_once_requeued(cluster: SlurmCluster, job_ids: list[int], stop: threading.Event) -> None:
    """Give each job RESUMED_TIME_LIMIT_MIN once Slurm re-queued it (it waits cred_expire + 1 s to start again)."""
    waiting = set(job_ids)
    while waiting and not stop.wait(1.0):
        for job_id in sorted(waiting):
            with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
                if int(cluster.job(job_id).get("Restarts", "0")) >= 1:
                    cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={RESUMED_TIME_LIMIT_MIN}")
                    waiting.discard(job_id)


@pytest.fixture(scope="module")
def jobs(slurm_nodes, warm_python, tmp_path_factory) -> Iterator[Jobs]:
    """Submitted first: the warned job (whose second node is drained once it runs, so that its re-queued attempt
    must run on another node set), the job whose warning comes too late and the one-node reference. The job that
    meets a read-only directory is submitted by its test, later: 20 tasks starting at once on 2 cores (5 jobs of 4
    tasks, as they were), with the other workers' tests, made the suite's first minutes too slow for the one-node
    cluster's scancel test. The time-limited jobs' later attempts get RESUMED_TIME_LIMIT_MIN."""
    started = Jobs()
    started.cluster = slurm_nodes
    started["limited"] = start(slurm_nodes, tmp_path_factory, "limited", *TIME_LIMIT, python=warm_python,
                               step_pause=WARNED_STEP_PAUSE, overrides=WARNING_ONLY, env=PROGRESS_EVERY)  # fmt: skip
    started["own"] = start(slurm_nodes, tmp_path_factory, "own", *LATE_WARNING, python=warm_python,
                           step_pause=OWN_STOP_STEP_PAUSE, overrides=OWN_STOP_MARGIN)  # fmt: skip
    started["one"] = start(slurm_nodes, tmp_path_factory, "one", python=warm_python, shape=ONE_NODE)
    running = slurm_nodes.wait(started["limited"].id, states={"RUNNING"}, timeout=120)
    started.drained = expand(slurm_nodes, running["NodeList"])[1]
    slurm_nodes.run("scontrol", "update", f"NodeName={started.drained}", "State=DRAIN", "Reason=dapo-test")
    stop = threading.Event()
    time_limited = [started["limited"].id, started["own"].id]
    watcher = threading.Thread(target=lengthen_once_requeued, args=(slurm_nodes, time_limited, stop), daemon=True)
    watcher.start()
    yield started
    stop.set()
    watcher.join(timeout=30)


def processes_of_jobs(cluster, node: str, only: str = "") -> list[str]:
    """The command lines of what runs on the node besides its slurmd (those holding `only`)."""
    found = []
    for pid in cluster.processes_on(node):
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not command.split(" ", 1)[0].endswith("slurmd") and only in command:
                found.append(command)
    return found


# parallel.peer_timeout_s of the node-failure run (default 120). Shorter was too short on 2 cores beside the
# module's other jobs and the suite's heaviest tests (load average 40-90): at 6 s a live rank went 7 s unheard
# before the node died; at 12 s the resumed attempt's store (rank 0's process) did not answer for 13 s.
PEER_TIMEOUT_S = 30


def test_a_node_that_dies_mid_step_stops_the_others_in_bounded_time_and_the_job_resumes_elsewhere(
    slurm_nodes, jobs, warm_python, tmp_path
):
    """The first node of the allocation dies: the batch script's host, rank 0's (the rendezvous store's, the run
    lock holder's). Its link goes down first, so its peers hear nothing, as from a host that lost power. First in
    this module, beside the jobs started with it (on other nodes); that node stays down."""
    overrides = ["checkpoint.save_interval=3", f"parallel.peer_timeout_s={PEER_TIMEOUT_S}"]
    job_id, run_dir = submit(  # not on READ_ONLY_NODE: a later test needs it alive
        slurm_nodes,
        tmp_path,
        "dies",
        f"--exclude={READ_ONLY_NODE}",
        overrides=overrides,
        shape=TWO_NODES,
        python=warm_python,
    )
    deadline = time.monotonic() + 400
    while not ((run_dir / "metrics.jsonl").exists() and len(rows(run_dir)) >= 7):  # the save of step 6 is done
        assert time.monotonic() < deadline, slurm_nodes.job(job_id)
        time.sleep(0.2)
    hosts = hosts_of(task_logs(tmp_path, "dies", 0))
    dead, other = hosts[0], hosts[1]  # task 0 on the first node, task 1 on the second
    failed_at = time.monotonic()
    slurm_nodes.fail_node(dead)
    print(f"{dead} failed at {time.strftime('%H:%M:%S')}")
    while ranks := processes_of_jobs(slurm_nodes, other, only="dapo_mcore.cli train"):  # rank 1 stops
        assert time.monotonic() - failed_at < SLURMD_TIMEOUT, ranks  # by themselves, before Slurm ends the job
        time.sleep(0.2)
    stopped_after = time.monotonic() - failed_at
    # well before Slurm declares the node DOWN (SLURMD_TIMEOUT) and far below the collective timeouts (30/240 min)
    assert stopped_after < PEER_TIMEOUT_S + 15, stopped_after
    lost = task_logs(tmp_path, "dies", 0)[1]
    assert re.search(rf"peer lost: .*\(rank 0's host, {dead}\).* \(exit 76\)", lost), lost[-3000:]
    record, out = finished(slurm_nodes, job_id, tmp_path, "dies", timeout=600)  # Slurm re-queues it (NODE_FAIL)
    assert record["Restarts"] == "1", out
    resumed = task_logs(tmp_path, "dies", 1)
    resumed_on = set(hosts_of(resumed).values())
    assert len(resumed_on) == 2 and dead not in resumed_on, resumed_on  # two nodes, neither the dead one
    assert re.search(rf"taking over the lock of run directory \S+ from pid \d+ on host {dead}: it was attempt 0",
                     resumed[0]), resumed[0][-3000:]  # fmt: skip
    assert re.search(r"resuming from \S+step_0000(06|09|12)", resumed[0]), resumed[0][-3000:]
    assert without_timings(rows(run_dir)) == without_timings(rows(jobs.reference()))
    for node in slurm_nodes.nodes:  # nothing of this job left behind, on any node (the others run theirs)
        assert processes_of_jobs(slurm_nodes, node, only=str(run_dir)) == [], node
    retrained = (run_dir / "metrics.rolled_back.jsonl").read_text().count("\n")  # trained since the save
    started = re.findall(r"(\d\d:\d\d:\d\d) job \d+ attempt 1 on", out)
    print(
        f"node failure: ranks left stopped after {stopped_after:.1f} s; the job re-queued by Slurm, attempt 1 "
        f"started at {started}; {retrained} steps trained again"
    )  # fmt: skip (slurm/README.md's figures, -s)


def test_the_batch_script_runs_2_tasks_on_one_node_to_the_end(jobs):
    one_node = jobs.reference()
    logs = task_logs(one_node.parent, "one")
    assert sorted(logs) == [0, 1]  # one log per task
    assert [row["step"] for row in rows(one_node)] == list(range(1, STEPS + 1))  # updates done
    assert "world=2 = TP 1 x PP 1 x DP 2" in logs[0]
    assert f"preflight passed on 2 ranks on 1 host ({hosts_of(logs)[0]})" in logs[0]


def first_lines(folder: Path, name: str, tasks: int, timeout: float = 400) -> dict[int, str]:
    """Each task's first log line (slurm/train.sbatch's: host, rendezvous, CPUs) of the job's first attempt."""
    deadline = time.monotonic() + timeout
    while True:
        logs = task_logs(folder, name)
        lines = {rank: text.splitlines()[0] for rank, text in logs.items() if "\n" in text}
        if len(lines) == tasks:
            return lines
        assert time.monotonic() < deadline, logs
        time.sleep(0.5)


# Slurm 22.05's srun without --cpus-per-task, in a job that asked for 2 a task, on this cluster (CORE_BINDING).
UNTOLD_SRUN = """#!/bin/bash
srun bash -c 'echo "srun alone: $(env -u OMP_NUM_THREADS nproc) CPUs"'
SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK srun bash -c 'echo "srun told: $(env -u OMP_NUM_THREADS nproc) CPUs"'
"""


def test_each_task_is_bound_to_the_cpus_per_task_the_job_asked(slurm_nodes, jobs, tmp_path):
    """On a cluster that binds tasks to cores (tests/slurm/conftest.py), slurm/train.sbatch passes the job's
    --cpus-per-task to srun (SRUN_CPUS_PER_TASK) and each task's first line names the CPUs it may use: both of a
    node's 2 for the two-node jobs, one each for the 2 tasks of the one-node job. Without it (the control, a plain
    srun in a job of --cpus-per-task 2) the task gets one core: what starved the verifier workers and the CPU Adam."""
    two = first_lines(jobs["limited"].folder, "limited", 2)
    for rank, line in two.items():
        assert f"; 2 CPUs (0-1) for --cpus-per-task={CPUS_PER_NODE})" in line, (rank, line)
    jobs.reference()
    one = first_lines(jobs["one"].folder, "one", 2)
    bound = sorted(re.search(r"; 1 CPU \((\d)\) for --cpus-per-task=1\)", line).group(1) for line in one.values())
    assert bound == ["0", "1"], one  # a core each
    options = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={CPUS_PER_NODE}", f"--output={tmp_path}/untold-%j.out"]
    job_id = slurm_nodes.submit(UNTOLD_SRUN, sbatch_options=options)
    record = slurm_nodes.wait(job_id, timeout=600)  # a node is free once the one-node job has ended
    out = (tmp_path / f"untold-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{out}"
    assert "srun alone: 1 CPUs" in out and f"srun told: {CPUS_PER_NODE} CPUs" in out, out


# The warned job's first attempt pauses WARNED_STEP_PAUSE (18 s) in each step: longer than this period, so its task 0
# log (a file, without the live bar) gets progress lines within a step, as a 7B step of an hour gets them every 2 min.
PROGRESS_EVERY_S = 5
PROGRESS_EVERY = {"DAPO_PROGRESS_EVERY_S": str(PROGRESS_EVERY_S)}
PROGRESS_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) INFO step (\d+)/\d+, \d+ s in: (.+), \d+ s so far", re.M)


def test_a_step_longer_than_the_progress_period_writes_progress_lines_to_the_task_log(jobs):
    job = jobs["limited"]
    deadline = time.monotonic() + 400
    while len(found := PROGRESS_LINE.findall(task_logs(job.folder, "limited").get(0, ""))) < 4:
        assert time.monotonic() < deadline, task_logs(job.folder, "limited").get(0, "")[-3000:]
        time.sleep(1.0)
    log = task_logs(job.folder, "limited")
    # the pause is the dynamic-sampling filter's, after the round's scoring
    assert any(what.startswith("after scoring the answers (round 1)") for *_, what in found), found
    seconds = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s, *_ in found]
    steps = [int(step) for *_, step, _ in found]
    gaps = [b - a for a, b, same in zip(seconds, seconds[1:], [x == y for x, y in zip(steps, steps[1:])]) if same]
    assert gaps and all(gap >= PROGRESS_EVERY_S - 1 for gap in gaps), found  # one a period, at most (1 s: the clock)
    assert not PROGRESS_LINE.search(log[1]), log[1][-2000:]  # rank 0's log alone


# The torchrun run's steps: its processes are fresh interpreters (torchrun's agents and workers), its steps beyond
# the warm-up prove nothing the reference's do not.
TORCHRUN_STEPS = 5


def test_torchrun_across_two_hosts_trains_the_recipe_with_the_metrics_of_one_node(slurm_nodes, jobs, tmp_path):
    """docs/gpu.md's two-node torchrun command, one per host, meeting by c10d rendezvous at node1 (beside the
    Slurm jobs there: each host's processes share its address). Its first TORCHRUN_STEPS steps (the learning
    rate is constant after its warm-up: the reference's first steps are what it trains)."""
    from tests.slurm.jobs import RECIPE

    run_dir = tmp_path / "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400", "--rdzv-id", "two-hosts",
               "-m", "dapo_mcore.cli", "train", *RECIPE, f"trainer.steps={TORCHRUN_STEPS}",
               f"logging.run_dir={run_dir}"]  # fmt: skip
    env = {**slurm_nodes.env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank, node in enumerate(("node1", "node2")):
        log = open(tmp_path / f"{node}.log", "wb")  # noqa: SIM115 - closed below
        argv = slurm_nodes.network.wrap(node, [*command[:5], "--node_rank", str(rank), *command[5:]])
        procs.append((subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=600) for proc, _ in procs]
    finally:
        for proc, log in procs:
            proc.kill()
            log.close()
    outputs = {node: (tmp_path / f"{node}.log").read_text() for node in ("node1", "node2")}
    assert codes == [0, 0], outputs
    assert "preflight passed on 2 ranks on 2 hosts" in outputs["node1"] + outputs["node2"]
    reference = without_timings(rows(jobs.reference()))[:TORCHRUN_STEPS]
    assert without_timings(rows(run_dir)) == reference


def test_a_problem_of_one_host_is_named_once_with_that_host(slurm_nodes, warm_python, tmp_path_factory):
    overrides = [f"checkpoint.dir={slurm_nodes.read_only_path}/checkpoints"]
    job = start(slurm_nodes, tmp_path_factory, "ro", f"--nodelist={READ_ONLY_NODE}", python=warm_python,
                overrides=overrides)  # fmt: skip
    record = slurm_nodes.wait(job.id, timeout=600)  # READ_ONLY_NODE may first end a re-queued attempt there
    out = job_output(job.folder, "ro", job.id)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", f"{record}\n{out}"
    task_logs_of_ro = task_logs(job.folder, "ro")
    ranks_there = sorted(rank for rank, host in hosts_of(task_logs_of_ro).items() if host == READ_ONLY_NODE)
    assert len(ranks_there) == 1, task_logs_of_ro  # the read-only node is one of the job's two
    logs = "".join(task_logs_of_ro.values())
    read_only = slurm_nodes.read_only_path
    problem = f"checkpoint directory {read_only}/checkpoints: cannot write in {read_only} (Read-only file system)"
    named = f"{problem} (rank {ranks_there[0]} on {READ_ONLY_NODE})"  # that host's, no other
    assert logs.count(problem) == 1 and named in logs, logs[-4000:]  # one task printed it, whichever failed first
    assert out.count(problem) == 1 and named in out, out  # and the job's output repeats it, with the job's code
    assert re.search(r"task \d on node\d failed first \(exit code 2; srun: \d+\)", out), out


def test_the_time_limit_warning_saves_on_both_hosts_and_the_job_resumes_on_another_node_set(slurm_nodes, jobs):
    """Slurm's own timer (a 5-minute job warned 90 s ahead, tests/slurm/jobs.py); the second node of the first
    attempt is drained while it runs (`jobs`), so the re-queued job must run on another node set."""
    job = jobs["limited"]
    try:
        record, out = job.finished(slurm_nodes, timeout=900)
    finally:
        slurm_nodes.run("scontrol", "update", f"NodeName={jobs.drained}", "State=RESUME")
    restarts = int(record["Restarts"])
    assert restarts >= 1 and out.count("saved before the time limit: re-queueing") == restarts, out
    first_nodes = expand(slurm_nodes, attempts_nodes(out)[0])
    second_nodes = set(hosts_of(task_logs(job.folder, "limited", 1)).values())
    assert len(second_nodes) == 2 and jobs.drained not in second_nodes, out  # the nodes of the second attempt
    first = task_logs(job.folder, "limited", 0)
    # 2 nodes x 1 task: each log names its host; the rendezvous is the first node, by name, seen from the other
    one, two = first_nodes
    assert two == jobs.drained
    assert hosts_of(first) == {0: one, 1: two} and f"rendezvous {one}:" in first[1]
    assert "world=2 = TP 1 x PP 1 x DP 2" in first[0]
    # each rank checked its host; gloo (the wait group's traffic) on the address rank 0's host name resolves to
    assert f"preflight passed on 2 ranks on 2 hosts ({one}, {two}); gloo on {one}'s address 10." in first[0]
    stopped = re.search(r"stopping \w+ step \d+ on Slurm's time-limit warning: saved to (\S+)", first[0])
    assert stopped, first[0][-3000:]
    # every step ran exactly once, in order, with the metrics of the one-node run
    assert not (job.run_dir / "metrics.rolled_back.jsonl").exists()
    assert without_timings(rows(job.run_dir)) == without_timings(rows(jobs.reference()))
    assert "resuming from" in task_logs(job.folder, "limited", 1)[0]


def test_a_job_whose_warning_comes_too_late_stops_by_itself_on_both_hosts_and_loses_no_step(slurm_nodes, jobs):
    """A warning 5 s ahead comes too late (tests/slurm/jobs.py): the run reads the job's end and stops by itself,
    every rank at the same step boundary, saves, and the script re-queues it."""
    job = jobs["own"]
    record, out = job.finished(slurm_nodes, timeout=900)
    restarts = int(record["Restarts"])
    assert restarts >= 1 and out.count("saved before the time limit: re-queueing") == restarts, out
    # every step ran exactly once, in order, with the metrics of the one-node run
    assert not (job.run_dir / "metrics.rolled_back.jsonl").exists()
    assert without_timings(rows(job.run_dir)) == without_timings(rows(jobs.reference()))
    first = task_logs(job.folder, "own", 0)[0]
    assert re.search(r"job ends at \d\d:\d\d \(in \d+ min\); stopping and saving by itself", first), first[-3000:]
    assert re.search(r"stopping \w+ step \d+ on the job's time limit \(a step of up to \d+ s", first), first[-3000:]
    # the run stopped before Slurm's warning came (it may come during the save: 0-30 s early, tests/slurm/cluster.py)
    assert "on Slurm's time-limit warning" not in first, first[-3000:]
    saved = next((job.folder / "logs").glob("own-*/attempt-0.stop.saved")).read_text()  # rank 0's mark
    assert saved.startswith("stopped by the job's time limit") and str(job.run_dir) in saved
