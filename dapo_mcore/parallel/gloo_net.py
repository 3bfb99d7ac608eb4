"""Which network interface gloo uses across hosts, chosen before the first gloo group is made.

gloo carries the run's wait group (the token exchange of every step, the preflight) and, on the CPU, everything.
Without GLOO_SOCKET_IFNAME each rank advertises the address its host's name resolves to: 127.0.1.1 on
Debian-style images (the hosts file maps the name to loopback), which peers on other hosts cannot reach, so a
job across hosts fails its first collective after the process group's timeout. NCCL's interfaces are set in
slurm/network.env; gloo takes no exclusion list ("^lo"), so its interface is chosen here, per host: the one whose
address routes to MASTER_ADDR, the rendezvous every rank reaches already. On MASTER_ADDR's own host (node 0) that
route is loopback (the name resolves to 127.0.1.1 there too), so node 0 takes its default route's interface, or
else the interface holding a non-loopback address of its name.
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
    gloo_route() then says what gloo uses. Raises PreflightError where no interface is found (_interface_for)."""
    _CHOSEN[:] = [_gloo_interface()]


def _gloo_interface() -> str:
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']}"
    host = socket.gethostname()
    own = _resolve(host)
    if not spans_hosts() or (own is not None and not _is_loopback(own)):
        return f"{host}'s address {own}"
    master = os.environ.get("MASTER_ADDR", "")
    interface, why = _interface_for(host, master)
    if interface is None:
        raise PreflightError(
            f"this job spans hosts, but {host}'s name resolves to {own or 'nothing'} (loopback: other hosts cannot "
            f"reach gloo there) and {why}: set GLOO_SOCKET_IFNAME to the interface of this host's cluster network "
            "(e.g. in slurm/network.env)"
        )
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    log.info("gloo: %s's name resolves to loopback (%s); using %s, %s (GLOO_SOCKET_IFNAME)", host, own, interface, why)
    return f"GLOO_SOCKET_IFNAME={interface} (chosen: {host}'s name resolves to {own}; {why})"


def _interface_for(host: str, master: str) -> tuple[str | None, str]:
    """The interface for gloo and why it was taken, or None and what was tried (the refusal's words)."""
    interface = interface_towards(master)
    if interface is not None:
        return interface, f"the interface towards MASTER_ADDR={master}"
    source = _route_source(master) if master else None
    if source is None or not _is_loopback(source):
        return None, f"no interface of {host} routes to MASTER_ADDR={master}"
    # MASTER_ADDR is this very host (node 0): its route says nothing about the other hosts, so take the interface
    # they most likely reach this host on (the default route's), else the one holding a real address of its name
    interface = default_route_interface()
    if interface is not None:
        return interface, f"the default route's interface (MASTER_ADDR={master} is this host)"
    interface = _interface_of_name(host)
    if interface is not None:
        return interface, f"the interface holding {host}'s address (MASTER_ADDR={master} is this host)"
    return None, (
        f"MASTER_ADDR={master} is this host (its route is loopback), {host} has no default route "
        f"({_ROUTE_TABLE}) and its name has no non-loopback address"
    )


def interface_towards(address: str) -> str | None:
    """The non-loopback interface this host would send to `address` from, or None."""
    local = _route_source(address)
    if local is None or _is_loopback(local):
        return None
    return _interface_holding(local)


def _route_source(address: str) -> str | None:
    """The source address of this host's route to `address`, or None where there is none. A UDP socket's connect
    picks the route's source address without sending anything."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def _interface_holding(address: str) -> str | None:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


_ROUTE_TABLE = "/proc/net/route"  # the kernel's IPv4 routes: hex fields, one route a line after a header


def default_route_interface() -> str | None:
    """The interface of this host's IPv4 default route (destination and mask 0.0.0.0, up; the lowest metric's where
    there are several), or None. Loopback is skipped: gloo there is what this module avoids."""
    try:
        with open(_ROUTE_TABLE) as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return None
    # columns: Iface Destination Gateway Flags RefCnt Use Metric Mask ...; Flags bit 0x1 is RTF_UP
    defaults = [r for r in rows if len(r) > 7 and r[1] == r[7] == "00000000" and int(r[3], 16) & 1 and r[0] != "lo"]
    return min(defaults, key=lambda r: int(r[6]))[0] if defaults else None


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def _resolve_all(host: str) -> list[str]:
    """Every IPv4 address `host`'s name resolves to (a hosts file may list 127.0.1.1 first, a real one after)."""
    try:
        return socket.gethostbyname_ex(host)[2]
    except OSError:
        return []


def _interface_of_name(host: str) -> str | None:
    """The interface holding a non-loopback address `host`'s name resolves to, or None."""
    for address in _resolve_all(host):
        interface = None if _is_loopback(address) else _interface_holding(address)
        if interface is not None:
            return interface
    return None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
