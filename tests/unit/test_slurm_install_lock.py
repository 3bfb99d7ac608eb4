"""The Slurm tier's install (tests/slurm/cluster.py SlurmCluster.ensure_installed) runs once at a time: the suite's
workers start the one-node and the multi-node clusters together, the second apt-get found dpkg's lock held, and
its 6 multi-node tests were skipped with the suite green. Under CI=true a cluster that cannot be had fails."""

import os
import threading

import pytest

from tests.slurm import cluster as slurm_cluster
from tests.slurm import conftest as slurm_conftest
from tests.slurm.cluster import CLIENTS, DAEMONS, SlurmCluster, SlurmUnavailable

# A stand-in apt-get: fails as dpkg does when another apt-get is running, else "installs" every binary.
FAKE_APT = """#!/bin/bash
exec 9>"$BIN/.dpkg-lock"
flock -n 9 || { echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit 100; }
[ "$1" = "-o" ] && shift 2
[ "$1" = "install" ] || exit 0
sleep 1
for b in $BINARIES; do printf '#!/bin/sh\\n' > "$BIN/$b"; chmod +x "$BIN/$b"; done
"""


def test_two_workers_installing_at_once_both_get_slurm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(FAKE_APT)
    (bin_dir / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("BIN", str(bin_dir))
    monkeypatch.setenv("BINARIES", " ".join((*DAEMONS, *CLIENTS)))
    # only the stand-in's binaries count (this machine may have Slurm installed)
    monkeypatch.setattr(
        slurm_cluster, "_which", lambda name: str(bin_dir / name) if (bin_dir / name).exists() else None
    )
    monkeypatch.setattr(slurm_cluster, "INSTALL_LOCK", tmp_path / "install.lock", raising=False)
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    assert SlurmCluster.missing()
    outcomes = []

    def worker():
        try:
            SlurmCluster.ensure_installed(timeout=60)
            outcomes.append("installed")
        except SlurmUnavailable as err:
            outcomes.append(str(err))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == ["installed", "installed"], outcomes
    assert not SlurmCluster.missing()


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_cluster_that_cannot_be_had_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    def no_slurm():
        raise SlurmUnavailable("apt-get install slurm-wlm munge failed (100)")

    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(SlurmCluster, "ensure_installed", staticmethod(no_slurm))
    with pytest.raises(outcome, match="no Slurm: apt-get install slurm-wlm munge failed"):
        next(slurm_conftest.running(SlurmCluster(), "/nonexistent", "Slurm did not start"))
