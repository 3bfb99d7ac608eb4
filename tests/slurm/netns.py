"""The network of a multi-node test cluster: one network namespace per node and one for the controller.

The controller's namespace holds a bridge; each node's namespace a veth pair's end (`eth0`) whose other end is a
port of that bridge. Every address is one this module assigns inside namespaces it created (SUBNET): nothing in
this machine's own namespace changes and no other address is contacted. A process runs "on" a node when started
through `wrap`: in the node's network namespace, with a UTS namespace of its own (its hostname is the node's name)
and a mount namespace in which a private hosts file (every node's name and address) covers /etc/hosts, so that the
machine's /etc/hosts is never edited. Whatever slurmd starts (slurmstepd, the job's tasks) inherits all three.

`nsenter --net`, not `ip netns exec`: the latter mounts a fresh /sys without /sys/fs/cgroup and slurmd then fails
("Unable to initialize cgroup plugin") (../shared/ENVIRONMENT.md, "Several Slurm nodes on one machine").
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.213.7"  # a /24 that exists only inside the namespaces below
PREFIX = "dapo-slurm-"  # every namespace this module makes: `<PREFIX><creator pid>-<n>-<member>`
NETNS_DIR = Path("/run/netns")
CONTROLLER = "ctl"


class NetworkUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`/`nsenter`/`unshare`, or the kernel refuses)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetworkUnavailable(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns_inode(path: Path) -> int | None:
    with contextlib.suppress(OSError):
        return path.stat().st_ino
    return None


def pids_in_netns(name: str) -> list[int]:
    """Every process whose network namespace is the named one (a process of the node)."""
    inode = _netns_inode(NETNS_DIR / name)
    if inode is None:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if (entry / "ns" / "net").stat().st_ino == inode:
                    found.append(int(entry.name))
    return found


def _kill_all(name: str, rounds: int = 10) -> None:
    for _ in range(rounds):
        pids = pids_in_netns(name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _delete(name: str) -> None:
    _kill_all(name)
    _ip("netns", "delete", name, check=False)  # its veth ends (and their peers) go with it


def _owner_alive(name: str) -> bool:
    pid = name[len(PREFIX) :].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces (and their processes) left by an earlier test process that died without its
    tear-down; the names of those removed."""
    names = [p.name for p in NETNS_DIR.glob(f"{PREFIX}*")] if NETNS_DIR.is_dir() else []
    stale = [name for name in names if not _owner_alive(name)]
    for name in stale:
        _delete(name)
    return stale


def check_available() -> None:
    if os.geteuid() != 0:
        raise NetworkUnavailable("network namespaces need root")
    missing = [tool for tool in ("ip", "nsenter", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        raise NetworkUnavailable(f"{', '.join(missing)} not installed")


_COUNT = 0


class NodeNetwork:
    """The controller's namespace with its bridge, and `nodes` node namespaces (node1..nodeN) on it."""

    def __init__(self, nodes: int):
        global _COUNT
        _COUNT += 1
        self.tag = f"{PREFIX}{os.getpid()}-{_COUNT}-"
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.hosts_file: Path | None = None
        self.created: list[str] = []

    def netns(self, member: str) -> str:
        return self.tag + member

    def address(self, member: str) -> str:
        return f"{SUBNET}.1" if member == CONTROLLER else f"{SUBNET}.{10 + self.nodes.index(member) + 1}"

    def create(self, hosts_file: Path) -> None:
        """The namespaces, the bridge, the links and the hosts file (written at `hosts_file`);
        NetworkUnavailable (with nothing left behind) when the kernel refuses."""
        check_available()
        self.hosts_file = hosts_file
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _create(self) -> None:
        ctl = self.netns(CONTROLLER)
        self._add_netns(ctl)
        _ip("-n", ctl, "link", "add", "br0", "type", "bridge")
        _ip("-n", ctl, "addr", "add", f"{self.address(CONTROLLER)}/24", "dev", "br0")
        for dev in ("br0", "lo"):
            _ip("-n", ctl, "link", "set", dev, "up")
        for node in self.nodes:
            ns = self.netns(node)
            self._add_netns(ns)
            _ip("-n", ctl, "link", "add", self._port(node), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", ctl, "link", "set", self._port(node), "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            for dev in ("eth0", "lo"):
                _ip("-n", ns, "link", "set", dev, "up")
        lines = ["127.0.0.1 localhost"] + [f"{self.address(m)} {m}" for m in (CONTROLLER, *self.nodes)]
        self.hosts_file.write_text("\n".join(lines) + "\n")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)

    def _port(self, node: str) -> str:
        return f"p{self.nodes.index(node) + 1}"  # the bridge's port to the node (names of 15 characters at most)

    def wrap(self, member: str, argv: list[str], read_only: list[Path] = ()) -> list[str]:
        """`argv` run on `member` (a node, or CONTROLLER): its network, its hostname, the private hosts file,
        and `read_only` paths mounted read-only there alone (a problem of one host)."""
        remount = "".join(f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))} && "
                          f"mount -o remount,bind,ro {shlex.quote(str(p))} && " for p in read_only)  # fmt: skip
        script = f'hostname "$1" && mount --bind "$2" /etc/hosts && {remount}shift 2 && exec "$@"'
        net = f"--net={NETNS_DIR / self.netns(member)}"
        return ["nsenter", net, "unshare", "--uts", "--mount", "sh", "-c", script, "on-node", member,
                str(self.hosts_file), *argv]  # fmt: skip

    def on_controller(self, argv: list[str]) -> list[str]:
        """A client command (sbatch, scontrol, ...) in the controller's network: it reaches slurmctld there."""
        return ["nsenter", f"--net={NETNS_DIR / self.netns(CONTROLLER)}", *argv]

    def pids(self, member: str) -> list[int]:
        return pids_in_netns(self.netns(member))

    def fail(self, node: str) -> None:
        """The node dies as a machine does: its link goes down first (so that no FIN or RST of its closing
        sockets reaches a peer: they hear nothing, as from a powered-off host), then every process on it is
        killed. The namespace stays (down) until destroy()."""
        _ip("-n", self.netns(CONTROLLER), "link", "set", self._port(node), "down", check=False)
        _ip("-n", self.netns(node), "link", "set", "eth0", "down", check=False)
        _kill_all(self.netns(node))

    def destroy(self) -> None:
        """Kill every process in the namespaces, delete them (the bridge and links go with them) and the hosts
        file. Safe to call twice and after a create() that failed midway."""
        for name in reversed(self.created):
            _delete(name)
        self.created.clear()
        if self.hosts_file is not None:
            self.hosts_file.unlink(missing_ok=True)
