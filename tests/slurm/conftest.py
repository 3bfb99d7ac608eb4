"""The `slurm_cluster` fixture: one private one-node Slurm cluster for the whole session (skips where none)."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import SlurmCluster, SlurmUnavailable


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    try:
        SlurmCluster.ensure_installed()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm: {exc}")
    cluster = SlurmCluster()
    try:
        cluster.start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"Slurm did not start: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
