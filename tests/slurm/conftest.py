"""The Slurm tier's clusters: `slurm_cluster`, one private one-node cluster for the whole session, and
`slurm_nodes`, nine nodes on this machine for the multi-node module (each skips, with the reason, where none)."""

from __future__ import annotations

import os

import pytest

from tests.slurm.cluster import CORE_BINDING, SlurmCluster, SlurmUnavailable


def unavailable(reason: str) -> None:
    """Skip, or under CI=true fail: CI must run the cluster tests, not pass without them."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: the Slurm tests must run)", pytrace=False)
    pytest.skip(reason)


def running(cluster: SlurmCluster, workdir, not_started: str):
    """Install Slurm if needed, start `cluster` in `workdir`, yield it and stop it; skip where either fails (fail
    under CI=true)."""
    try:
        SlurmCluster.ensure_installed()
    except SlurmUnavailable as exc:
        unavailable(f"no Slurm: {exc}")
    try:
        cluster.start(workdir)
    except SlurmUnavailable as exc:
        unavailable(f"{not_started}: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    # KillWait (SIGTERM to SIGKILL) 90 s, not 30: the scancel test's run saves after SIGTERM, and at a load average
    # of 45 on 2 cores (the suite's first minutes) its save had not ended 30 s later
    cluster = SlurmCluster(kill_wait=90)
    yield from running(cluster, tmp_path_factory.mktemp("slurm"), "Slurm did not start")


# The multi-node tests' cluster: node1..node9, each a network namespace with its own address, hostname and slurmd
# (tests/slurm/netns.py), enough for the module's jobs to run at once on nodes of their own (2 + 2 + 1 + 2 + 2,
# tests/slurm/test_multinode.py). 2 CPUs each, this machine's 2 cores, bound as a site binds them (CORE_BINDING):
# 2 tasks of 1 CPU on one node, or 1 task of 2 CPUs a node (each job --exclusive). The tasks' runs fork from a
# warm server (tests/slurm/warm_tasks.py), outside the binding: only each task's shell and client are bound. Slurm
# declares a silent node DOWN after SLURMD_TIMEOUT s (default 300): long enough that a test can tell the run's own
# liveness stop (parallel.peer_timeout_s) from Slurm ending the job. A re-queued job may start cred_expire + 1 s
# after the re-queue (5 s: Slurm's minimum). On READ_ONLY_NODE alone the folder `read_only_path` is read-only.
NODES = 9
CPUS_PER_NODE = 2
SLURMD_TIMEOUT = 60
READ_ONLY_NODE = "node9"


@pytest.fixture(scope="module")
def slurm_nodes(tmp_path_factory):
    read_only = tmp_path_factory.mktemp(f"read_only_on_{READ_ONLY_NODE}")
    cluster = SlurmCluster(
        nodes=NODES,
        cpus=CPUS_PER_NODE,
        cred_expire=5,
        slurmd_timeout=SLURMD_TIMEOUT,
        read_only_on={READ_ONLY_NODE: [read_only]},
        task_plugin=CORE_BINDING,
    )
    cluster.read_only_path = read_only
    yield from running(cluster, tmp_path_factory.mktemp("slurm_nodes"), "no multi-node Slurm here")
