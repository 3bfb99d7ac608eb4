"""gloo's interface across hosts (parallel/gloo_net.py): where a host's name resolves to loopback (127.0.1.1 on
Debian-style images), ranks on other hosts could not reach its gloo pairs and the job failed its first collective
after the process group's timeout; the interface that routes to MASTER_ADDR is taken instead, and on MASTER_ADDR's
own host (node 0, whose route there is loopback) the default route's interface."""

from __future__ import annotations

import socket

import psutil
import pytest

from dapo_mcore.parallel import gloo_net
from dapo_mcore.utils.errors import PreflightError


@pytest.fixture
def two_hosts(monkeypatch, tmp_path):
    for key in ("GLOO_SOCKET_IFNAME", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.setenv(key, "")  # recorded, so the GLOO_SOCKET_IFNAME a test's choice sets is undone after it
        monkeypatch.delenv(key)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(gloo_net, "_CHOSEN", [])
    monkeypatch.setattr(gloo_net, "_resolve", lambda host: "127.0.1.1")  # the Debian hosts-file line
    monkeypatch.setattr(gloo_net, "_resolve_all", lambda host: ["127.0.1.1"])
    routes(monkeypatch, tmp_path)  # no default route unless a test writes one: this machine's must not matter
    return monkeypatch


def routes(monkeypatch, tmp_path, *rows: str) -> None:
    """Point the module at a /proc/net/route of these rows (Iface Destination Gateway Flags RefCnt Use Metric Mask)."""
    table = tmp_path / "route"
    header = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"
    table.write_text("\n".join([header, *(row + "\t0\t0\t0" for row in rows)]) + "\n")
    monkeypatch.setattr(gloo_net, "_ROUTE_TABLE", str(table))


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
        == f"GLOO_SOCKET_IFNAME={name} (chosen: {socket.gethostname()}'s name resolves to 127.0.1.1; "
        f"the interface towards MASTER_ADDR={address})"
    )


def test_without_an_interface_towards_the_master_the_job_stops_with_one_line(two_hosts):
    two_hosts.setenv("MASTER_ADDR", "10.9.8.7")
    two_hosts.setattr(gloo_net, "_route_source", lambda address: None)  # no route there at all
    with pytest.raises(PreflightError, match="resolves to 127.0.1.1 .* routes to MASTER_ADDR=10.9.8.7: set GLOO_"):
        gloo_net.choose_gloo_interface()
    assert "GLOO_SOCKET_IFNAME" not in gloo_net.os.environ


def test_node_0_of_a_job_across_hosts_gives_gloo_its_default_routes_interface(two_hosts, tmp_path):
    # MASTER_ADDR is node 0's name, which resolves to 127.0.1.1 there too; its route is loopback
    two_hosts.setenv("WORLD_SIZE", "16")
    two_hosts.setenv("LOCAL_WORLD_SIZE", "8")
    two_hosts.setenv("MASTER_ADDR", "127.0.1.1")
    routes(
        two_hosts,
        tmp_path,
        "eth9\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF",  # a subnet's route, not the default
        "eth8\t00000000\t010200C0\t0002\t0\t0\t0\t00000000",  # a default route that is down
        "eth1\t00000000\t010300C0\t0003\t0\t0\t200\t00000000",
        "eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000",  # the lowest metric's
    )
    gloo_net.choose_gloo_interface()
    assert gloo_net.os.environ["GLOO_SOCKET_IFNAME"] == "eth0"
    assert gloo_net.gloo_route() == (
        f"GLOO_SOCKET_IFNAME=eth0 (chosen: {socket.gethostname()}'s name resolves to 127.0.1.1; "
        "the default route's interface (MASTER_ADDR=127.0.1.1 is this host))"
    )


def test_node_0_without_a_default_route_takes_the_interface_of_its_names_own_address(two_hosts):
    address, name = own_interface()
    two_hosts.setenv("MASTER_ADDR", "127.0.1.1")
    two_hosts.setattr(gloo_net, "_resolve_all", lambda host: ["127.0.1.1", address])
    gloo_net.choose_gloo_interface()
    assert gloo_net.os.environ["GLOO_SOCKET_IFNAME"] == name
    assert "the interface holding" in gloo_net.gloo_route()


def test_node_0_without_a_default_route_or_another_address_stops_with_one_line_of_what_was_tried(two_hosts):
    two_hosts.setenv("MASTER_ADDR", "127.0.1.1")
    with pytest.raises(PreflightError) as refused:
        gloo_net.choose_gloo_interface()
    message = str(refused.value)
    assert "\n" not in message
    for tried in ("MASTER_ADDR=127.0.1.1 is this host", "no default route", "no non-loopback address"):
        assert tried in message
    assert "set GLOO_SOCKET_IFNAME" in message
    assert "GLOO_SOCKET_IFNAME" not in gloo_net.os.environ


def test_a_one_host_job_keeps_loopback_with_master_addr_127_0_1_1(two_hosts, tmp_path):
    two_hosts.setenv("WORLD_SIZE", "8")
    two_hosts.setenv("LOCAL_WORLD_SIZE", "8")
    two_hosts.setenv("MASTER_ADDR", "127.0.1.1")
    routes(two_hosts, tmp_path, "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000")
    gloo_net.choose_gloo_interface()  # every rank is on this host: loopback reaches them all
    assert "GLOO_SOCKET_IFNAME" not in gloo_net.os.environ
    assert gloo_net.gloo_route() == f"{socket.gethostname()}'s address 127.0.1.1"


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
