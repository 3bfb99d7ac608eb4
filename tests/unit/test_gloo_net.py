"""gloo's interface across hosts (parallel/gloo_net.py): where a host's name resolves to loopback (127.0.1.1 on
Debian-style images), ranks on other hosts could not reach its gloo pairs and the job failed its first collective
after the process group's timeout; the interface that routes to MASTER_ADDR is taken instead."""

from __future__ import annotations

import socket

import psutil
import pytest

from dapo_mcore.parallel import gloo_net
from dapo_mcore.utils.errors import PreflightError


@pytest.fixture
def two_hosts(monkeypatch):
    for key in ("GLOO_SOCKET_IFNAME", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(gloo_net, "_resolve", lambda host: "127.0.1.1")  # the Debian hosts-file line
    return monkeypatch


def test_a_job_spans_hosts_by_torchrun_or_slurm_counts(monkeypatch):
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    assert gloo_net.spans_hosts({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert not gloo_net.spans_hosts({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})
    assert gloo_net.spans_hosts({"WORLD_SIZE": "2", "SLURM_JOB_NUM_NODES": "2"})
    assert not gloo_net.spans_hosts({})


def test_across_hosts_a_loopback_name_gives_gloo_the_interface_towards_the_master(two_hosts):
    address, name = own_interface()
    two_hosts.setenv("MASTER_ADDR", address)
    gloo_net.choose_gloo_interface()
    assert gloo_net.os.environ["GLOO_SOCKET_IFNAME"] == name
    assert (
        gloo_net.gloo_route()
        == f"GLOO_SOCKET_IFNAME={name} (chosen: {socket.gethostname()}'s name resolves to 127.0.1.1)"
    )


def test_without_an_interface_towards_the_master_the_job_stops_with_one_line(two_hosts):
    two_hosts.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(PreflightError, match="resolves to 127.0.1.1 .* set GLOO_SOCKET_IFNAME"):
        gloo_net.choose_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in gloo_net.os.environ


def test_a_users_interface_and_a_one_host_job_are_left_as_they_are(two_hosts):
    two_hosts.setenv("GLOO_SOCKET_IFNAME", "ib0")
    gloo_net.choose_gloo_interface()
    assert gloo_net.gloo_route() == "GLOO_SOCKET_IFNAME=ib0"
    two_hosts.delenv("GLOO_SOCKET_IFNAME")
    two_hosts.setenv("LOCAL_WORLD_SIZE", "4")  # one host: loopback is reachable by every rank
    gloo_net.choose_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in gloo_net.os.environ


def own_interface() -> tuple[str, str]:
    """An IPv4 address of this host's own on a non-loopback interface, and that interface."""
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address, name
    pytest.fail("this host has no non-loopback IPv4 interface to route to")
