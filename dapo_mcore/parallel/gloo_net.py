"""Which network interface gloo uses across hosts, chosen before the first gloo group is made.

gloo carries the run's wait group (the token exchange of every step, the preflight) and, on the CPU, everything.
Without GLOO_SOCKET_IFNAME each rank advertises the address its host's name resolves to: 127.0.1.1 on
Debian-style images (the hosts file maps the name to loopback), which peers on other hosts cannot reach, so a
job across hosts fails its first collective after the process group's timeout. NCCL's interfaces are set in
slurm/network.env; gloo takes no exclusion list ("^lo"), so its interface is chosen here, per host: the one whose
address routes to MASTER_ADDR, the rendezvous every rank reaches already.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

from dapo_mcore.utils.errors import PreflightError
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


def spans_hosts(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the job's ranks are on more than one host (torchrun's and srun's variables)."""
    world = int(environ.get("WORLD_SIZE", "1"))
    local = int(environ.get("LOCAL_WORLD_SIZE", world))
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    return world > local or nodes > 1


_CHOSEN: list[str] = []  # what choose_gloo_interface found, for the preflight line


def gloo_route() -> str | None:
    """What gloo uses on this host, as choose_gloo_interface found it (None before it ran)."""
    return _CHOSEN[-1] if _CHOSEN else None


def choose_gloo_interface() -> None:
    """Set GLOO_SOCKET_IFNAME where the job spans hosts, it is unset and this host's name resolves to loopback;
    gloo_route() then says what gloo uses. Raises PreflightError where no interface reaches MASTER_ADDR."""
    _CHOSEN[:] = [_gloo_interface()]


def _gloo_interface() -> str:
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}"
    host = socket.gethostname()
    own = _resolve(host)
    if not spans_hosts() or (own is not None and not _is_loopback(own)):
        return f"{host}'s address {own}"
    master = os.environ.get("MASTER_ADDR", "")
    interface = interface_towards(master)
    if interface is None:
        raise PreflightError(
            f"this job spans hosts, but {host}'s name resolves to {own or 'nothing'} (loopback: other hosts cannot "
            f"reach gloo there) and no interface of {host} routes to MASTER_ADDR={master}: set GLOO_SOCKET_IFNAME "
            "to the interface of this host's cluster network (e.g. in slurm/network.env)"
        )
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    log.info("gloo: %s's name resolves to loopback (%s); using %s, which reaches MASTER_ADDR=%s (GLOO_SOCKET_IFNAME)",
             host, own, interface, master)  # fmt: skip
    return f"GLOO_SOCKET_IFNAME={interface} (chosen: {host}'s name resolves to {own})"


def interface_towards(address: str) -> str | None:
    """The non-loopback interface this host would send to `address` from, or None. A UDP socket's connect picks
    the route's source address without sending anything."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    if _is_loopback(local):
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return name
    return None


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
