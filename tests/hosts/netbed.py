"""A multi-host test bed on one Linux machine: hosts as network namespaces joined by a switch.

A bed is N hosts and a switch, each one a network namespace of its own::

    host h0: namespace <bed>-h0, eth0 10.213.0.1/24 --veth-- port h0 --+
    host h1: namespace <bed>-h1, eth0 10.213.0.2/24 --veth-- port h1 --+-- bridge br0,
    ...                                                                     namespace <bed>-sw

Each host has its own network stack (``lo`` up, ``eth0`` on the bed's subnet), its own host
name (``h0``, ``h1``, ...: every command runs in a UTS namespace of its own, named so) and an
``/etc/hosts`` naming every host of the bed (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts``
over it), so that programs that look up their host name (aiodist's host identity, gloo's
default device, Open MPI) find eth0's address and see N machines. The root namespace gets no
address, route or link: the bridge lives in the switch's namespace and every veth is created in
place. What the hosts share is the rest of the machine: the file system (``/dev/shm``
included), the CPUs and the kernel. aiodist tells them apart by host name (its host identity
is the host name and the boot id) and so never uses shared memory between ranks of different
hosts; with one identity for all (``AIODIST_HOST_ID=x`` everywhere) it would, and could.

A link can be shaped with a token bucket (``tc qdisc ... tbf``) in both directions: on the
host's ``eth0`` (what it sends) and on its switch port (what it receives). There is no latency
or loss emulation (``netem`` is not available on every kernel this runs on).

Names: a bed made by a program is ``aiodistbed-p<pid>-<token>`` (pid: the creating process);
one stood up by hand is ``aiodistbed-<name>``. Whatever makes a bed also sweeps the beds whose
creating process is gone (a test killed before its clean-up ran), so none outlives a crash for
long. Needs root, ``ip`` (iproute2), ``unshare`` (util-linux) and ``tc`` for shaping.

From a shell (run from the repository root)::

    python -m tests.hosts.netbed up --hosts 2 --rate 10gbit --name bench
    python -m tests.hosts.netbed exec bench h1 -- python -c 'import socket; print(socket.gethostname())'
    python -m tests.hosts.netbed shape bench --rate 1gbit
    python -m tests.hosts.netbed ls
    python -m tests.hosts.netbed down bench

From Python::

    with Bed.create(2, rate="10gbit") as bed:
        proc = bed.run(bed.hosts[1], ["python", "script.py"], env=env)
        bed.link_down(1)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PREFIX", "Bed", "BedError", "Host", "Shaping", "sweep", "unavailable"]

PREFIX = "aiodistbed-"
SUBNET = "10.213.0.0/24"
#: The interface of each host (its end of the veth to the switch) and the switch's bridge.
HOST_IF = "eth0"
BRIDGE = "br0"
NETNS_ETC = Path("/etc/netns")
_OWNED = re.compile(rf"^{re.escape(PREFIX)}p(\d+)-[0-9a-f]+$")
_IP_TIMEOUT = 20.0
_PR_SET_PDEATHSIG = 1


class BedError(RuntimeError):
    """A command that builds, changes or tears down a bed failed; the message says which and why."""


# -- plumbing -----------------------------------------------------------------------------


def _cmd(*argv: str, check: bool = True) -> str:
    """Run one command of iproute2 (or tc); its stdout. Raises BedError naming it and its error."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BedError(f"{shlex.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise BedError(f"{shlex.join(argv)}: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done.stdout


def _namespaces() -> list[str]:
    """Every named network namespace of the machine (``ip netns list``)."""
    out = _cmd("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids_in(netns: str) -> list[int]:
    out = _cmd("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all(netns: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = _pids_in(netns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it holds no socket and no namespace)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _remove_namespaces(names: Sequence[str]) -> list[str]:
    """SIGKILL every process in ``names``, then delete them (and their /etc/netns files).

    Idempotent and best effort: every step runs whatever failed before it. Returns what could
    not be done. The switch's namespace holds no process and owns one end of every veth, so
    deleting it removes every link of the bed even when a host's process will not die.
    """
    problems: list[str] = []
    deadline = time.monotonic() + 5.0
    while True:  # (again while a dying launcher's children may still be appearing)
        alive = [p for name in names for p in _kill_all(name) if not _gone(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if alive:
        problems.append(f"processes still alive after SIGKILL: {alive}")
    for name in names:
        done = subprocess.run(
            ["ip", "netns", "del", name], capture_output=True, text=True, timeout=_IP_TIMEOUT
        )
        if done.returncode != 0 and name in _namespaces():
            problems.append(f"ip netns del {name}: {done.stderr.strip()}")
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    return problems


def _bed_names() -> dict[str, list[str]]:
    """Bed name -> its namespaces, for every bed on the machine."""
    beds: dict[str, list[str]] = {}
    for ns in _namespaces():
        if ns.startswith(PREFIX) and "-" in ns[len(PREFIX) :]:
            beds.setdefault(ns.rsplit("-", 1)[0], []).append(ns)
    return beds


def _owner(bed: str) -> int | None:
    """The pid that made ``bed`` (None: made by hand, kept until ``down``)."""
    m = _OWNED.match(bed)
    return int(m.group(1)) if m else None


def sweep() -> list[str]:
    """Remove every bed whose creating process is gone; returns their names.

    (A reused pid keeps its bed until that process ends too: a bed is never taken from a live
    owner.)
    """
    stale = [bed for bed in _bed_names() if (pid := _owner(bed)) is not None and not _alive(pid)]
    for bed in stale:
        _remove_namespaces(_bed_names().get(bed, []))
    return stale


def unavailable() -> str | None:
    """Why no bed can be made here (None: one can): not root, a tool missing, or the kernel
    refusing network namespaces (a container without the capability)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"the {tool} command ({package}) is not installed"
    probe = f"{PREFIX}p{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _cmd("ip", "netns", "add", probe)
    except BedError as exc:
        return f"cannot create a network namespace here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_IP_TIMEOUT)
    return None


# -- shaping ------------------------------------------------------------------------------

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``10gbit`` or ``100mbit``.

    Raises:
        ValueError: another spelling (tc's ``bps`` means bytes per second: refused here to
            avoid an 8x surprise).
    """
    m = _RATE.match(rate.strip().lower())
    if m is None:
        raise ValueError(
            f"rate {rate!r}: write it as tc does in bits per second, e.g. 10gbit, 1gbit, 100mbit"
        )
    return float(m.group(1)) * _SCALE[m.group(2)]


@dataclass(frozen=True, slots=True)
class Shaping:
    """A token bucket on a link, applied in both directions.

    Attributes:
        rate: a tc rate in bits per second (``10gbit``).
        burst: bytes the bucket holds (tc's ``burst``): what may leave back to back at the
            interface's own speed. Default: 1 ms at the rate, at least 64 KiB (one segment of
            the kernel's segmentation offload). One Python TCP stream measured 0.96 Gbit/s
            through ``1gbit`` and 9.5 Gbit/s through ``10gbit`` (24-33 Gbit/s unshaped).
        latency: the longest a packet may wait in the queue before it is dropped (tc's
            ``latency``; the queue holds rate x latency bytes): 10 ms by default.
    """

    rate: str
    burst: int | None = None
    latency: str = "10ms"

    def tbf_args(self) -> list[str]:
        burst = self.burst if self.burst is not None else max(64 * 1024, int(rate_bits(self.rate) / 8 / 1000))
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", self.latency]


# -- the bed ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Host:
    """One host of a bed.

    Attributes:
        index: 0..N-1. name: its host name (``h0``), also its name in the bed's /etc/hosts
        and its port on the switch. netns: its network namespace. addr: eth0's IPv4 address.
    """

    index: int
    name: str
    netns: str
    addr: str


def _die_with_parent() -> Callable[[], None]:
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))

    return preexec


class Bed:
    """N hosts and a switch (see the module docstring). Make one with :meth:`create`, or
    :meth:`attach` to one that exists; :meth:`destroy` (or leaving its ``with`` block) removes
    it and every process in it."""

    def __init__(self, name: str, hosts: Sequence[Host], prefixlen: int) -> None:
        self.name = name
        self.hosts = tuple(hosts)
        self.switch = f"{name}-sw"
        self.prefixlen = prefixlen

    # -- making one -----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        n_hosts: int,
        *,
        shaping: Shaping | None = None,
        subnet: str = SUBNET,
        mtu: int = 1500,
        name: str | None = None,
    ) -> Bed:
        """Make a bed of ``n_hosts`` hosts on ``subnet`` (host k gets its (k+1)-th address).

        ``name``: a bed kept until ``down`` (by hand); None: one owned by this process, swept
        once it is gone. Stale beds are swept first. On any failure what was made is removed.

        Raises:
            BedError: a command failed (the message names it), or ``name`` is taken.
            ValueError: too many hosts for ``subnet``, a bad name or rate.
        """
        if n_hosts < 1:
            raise ValueError(f"a bed needs at least one host, not {n_hosts}")
        net = ipaddress.IPv4Network(subnet)
        if n_hosts > net.num_addresses - 2:
            raise ValueError(f"{n_hosts} hosts do not fit in {subnet}")
        if name is not None and not re.fullmatch(r"[a-z][a-z0-9]{0,15}", name):
            raise ValueError(f"bed name {name!r}: a lower-case letter, then up to 15 letters or digits")
        if shaping is not None:
            shaping.tbf_args()  # a bad rate fails before anything is made
        sweep()
        bed_name = f"{PREFIX}{name}" if name else f"{PREFIX}p{os.getpid()}-{secrets.token_hex(3)}"
        if bed_name in _bed_names():
            raise BedError(f"a bed named {name!r} exists already: remove it first (down {name})")
        addrs = list(net.hosts())[:n_hosts]
        hosts = [Host(k, f"h{k}", f"{bed_name}-h{k}", str(addrs[k])) for k in range(n_hosts)]
        bed = cls(bed_name, hosts, net.prefixlen)
        try:
            bed._build(mtu)
            if shaping is not None:
                for host in hosts:
                    bed.shape(host, shaping)
        except BaseException:
            with contextlib.suppress(BedError):
                bed.destroy()
            raise
        return bed

    def _build(self, mtu: int) -> None:
        sw = self.switch
        _cmd("ip", "netns", "add", sw)
        _cmd("ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge")
        _cmd("ip", "-n", sw, "link", "set", BRIDGE, "up")
        _cmd("ip", "-n", sw, "link", "set", "lo", "up")
        for host in self.hosts:
            _cmd("ip", "netns", "add", host.netns)
            # Both ends are made in their namespaces: nothing appears in the root namespace.
            _cmd(
                "ip", "link", "add", HOST_IF, "netns", host.netns, "mtu", str(mtu), "type", "veth",
                "peer", "name", host.name, "netns", sw, "mtu", str(mtu),
            )  # fmt: skip
            _cmd("ip", "-n", sw, "link", "set", host.name, "master", BRIDGE)
            _cmd("ip", "-n", sw, "link", "set", host.name, "up")
            _cmd("ip", "-n", host.netns, "link", "set", "lo", "up")
            _cmd("ip", "-n", host.netns, "addr", "add", f"{host.addr}/{self.prefixlen}", "dev", HOST_IF)
            _cmd("ip", "-n", host.netns, "link", "set", HOST_IF, "up")
        names = "".join(f"{h.addr}\t{h.name}\n" for h in self.hosts)
        for host in self.hosts:
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{names}")

    @classmethod
    def attach(cls, name: str) -> Bed:
        """The bed called ``name`` (``bench``, or a full ``aiodistbed-...`` name), read back from
        its namespaces.

        Raises:
            BedError: no such bed.
        """
        full = name if name.startswith(PREFIX) else f"{PREFIX}{name}"
        spaces = _bed_names().get(full)
        if not spaces:
            raise BedError(f"no bed named {name!r} (python -m tests.hosts.netbed ls lists them)")
        hosts: list[Host] = []
        prefixlen = 24
        numbered = {int(m.group(1)): ns for ns in spaces if (m := re.search(r"-h(\d+)$", ns))}
        for k, ns in sorted(numbered.items()):
            info = json.loads(_cmd("ip", "-n", ns, "-j", "-4", "addr", "show", "dev", HOST_IF) or "[]")
            addr = next((a for i in info for a in i.get("addr_info", [])), None)
            if addr is None:
                raise BedError(f"{ns} has no IPv4 address on {HOST_IF}: the bed is half made or half removed")
            prefixlen = int(addr["prefixlen"])
            hosts.append(Host(k, f"h{k}", ns, addr["local"]))
        return cls(full, hosts, prefixlen)

    def destroy(self) -> None:
        """SIGKILL every process in the bed, remove its namespaces and files. Idempotent.

        Raises:
            BedError: something could not be removed (everything else was).
        """
        names = [h.netns for h in self.hosts] + [self.switch]
        problems = _remove_namespaces(names)
        if problems:
            raise BedError(f"bed {self.name}: " + "; ".join(problems))

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # -- using one ------------------------------------------------------------------------
    def host(self, which: Host | int | str) -> Host:
        """A host by index, by name (``h1``) or itself."""
        if isinstance(which, Host):
            return which
        for host in self.hosts:
            if which in (host.index, host.name):
                return host
        raise ValueError(
            f"bed {self.name} has no host {which!r} (it has {', '.join(h.name for h in self.hosts)})"
        )

    def argv(self, host: Host | int | str, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on ``host``: in its network namespace, with its
        /etc/hosts and, in a UTS namespace of its own, its host name."""
        h = self.host(host)
        name_it = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
        return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--", "sh", "-c", name_it, h.name, *argv]

    def run(
        self,
        host: Host | int | str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        die_with_parent: bool = True,
        **popen: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host``; the Popen is the program itself (every wrapper execs).

        ``env``: its environment (None: this process's). ``die_with_parent``: the kernel
        SIGKILLs it when this process dies (a killed test leaves no job running). Other keyword
        arguments go to ``subprocess.Popen`` (``stdout``, ``cwd``, ``text`` ...).
        """
        if die_with_parent and "preexec_fn" not in popen:
            popen["preexec_fn"] = _die_with_parent()
        return subprocess.Popen(self.argv(host, argv), env=dict(env) if env is not None else None, **popen)

    def pids(self, host: Host | int | str) -> list[int]:
        """The processes running on ``host`` (those in its network namespace)."""
        return _pids_in(self.host(host).netns)

    def kill(self, host: Host | int | str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process on ``host`` (SIGKILL: the host dies); their pids."""
        return _kill_all(self.host(host).netns, sig)

    def link_down(self, host: Host | int | str) -> None:
        """Cut ``host``'s link: its eth0 goes down (its switch port loses carrier too). No FIN
        or RST reaches anyone: packets to and from it vanish."""
        _cmd("ip", "-n", self.host(host).netns, "link", "set", HOST_IF, "down")

    def link_up(self, host: Host | int | str) -> None:
        _cmd("ip", "-n", self.host(host).netns, "link", "set", HOST_IF, "up")

    def shape(self, host: Host | int | str, shaping: Shaping | None) -> None:
        """Put a token bucket on ``host``'s link, both directions (None: take it off)."""
        h = self.host(host)
        for ns, dev in ((h.netns, HOST_IF), (self.switch, h.name)):
            if shaping is None:
                _cmd("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _cmd("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *shaping.tbf_args())

    def shaping(self, host: Host | int | str) -> str:
        """What shapes ``host``'s link, as tc shows it (both directions), or ``none``."""
        h = self.host(host)
        shown = []
        for ns, dev in ((h.netns, HOST_IF), (self.switch, h.name)):
            qd = _cmd("tc", "-n", ns, "qdisc", "show", "dev", dev, check=False)
            tbf = next((line for line in qd.splitlines() if " tbf " in f" {line} "), "")
            m = re.search(r"\brate .*", tbf)
            shown.append(m.group(0).strip() if m else "none")
        return shown[0] if shown[0] == shown[1] else f"out: {shown[0]}; in: {shown[1]}"

    def describe(self) -> dict[str, Any]:
        owner = _owner(self.name)
        return {
            "bed": self.name,
            "owner_pid": owner,
            "switch": self.switch,
            "hosts": [
                {
                    "name": h.name,
                    "netns": h.netns,
                    "addr": h.addr,
                    "interface": HOST_IF,
                    "shaping": self.shaping(h),
                    "pids": self.pids(h),
                }
                for h in self.hosts
            ],
        }


# -- command line -------------------------------------------------------------------------


def _print_bed(bed: Bed) -> None:
    d = bed.describe()
    owner = f" (owned by pid {d['owner_pid']})" if d["owner_pid"] else ""
    print(f"bed {bed.name}{owner}: {len(bed.hosts)} hosts on a bridge in namespace {bed.switch}")
    for h in d["hosts"]:
        print(f"  {h['name']}  {h['addr']:<15} netns {h['netns']}  {h['interface']}: {h['shaping']}"
              + (f"  pids {h['pids']}" if h["pids"] else ""))  # fmt: skip


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.hosts.netbed",
        description="Stand up a multi-host bed (network namespaces on a bridge) on this machine, "
        "run programs on its hosts, shape or cut their links, tear it down. Needs root.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make a bed and print its hosts")
    up.add_argument("--name", default="bed", help="the bed's name (default: bed)")
    up.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    up.add_argument("--subnet", default=SUBNET, help=f"IPv4 subnet of the hosts (default {SUBNET})")
    up.add_argument("--mtu", type=int, default=1500, help="MTU of every link (default 1500)")
    for p in (up, shape := sub.add_parser("shape", help="shape (or unshape) links of a bed")):
        p.add_argument("--rate", help="token-bucket rate of each link, both directions, e.g. 10gbit, 1gbit")
        p.add_argument(
            "--burst", type=int, help="bucket size in bytes (default: 1 ms at the rate, >= 64 KiB)"
        )
        p.add_argument("--latency", default="10ms", help="longest queueing before a drop (default 10ms)")
    shape.add_argument("name")
    shape.add_argument("host", nargs="?", help="one host (h0, ...); default: every host")
    shape.add_argument("--off", action="store_true", help="remove the shaping")
    down = sub.add_parser("down", help="remove a bed and every process in it (and stale beds)")
    down.add_argument("name", nargs="*", help="the beds (default: every bed made by hand)")
    sub.add_parser("ls", help="list the beds on this machine")
    ex = sub.add_parser("exec", help="run a command on a host of a bed: exec NAME HOST -- CMD ...")
    ex.add_argument("name")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    link = sub.add_parser("link", help="cut or restore a host's link: link NAME HOST down|up")
    link.add_argument("name")
    link.add_argument("host")
    link.add_argument("state", choices=("down", "up"))
    args = parser.parse_args(argv)

    try:
        if args.cmd == "up":
            if (why := unavailable()) is not None:
                print(f"netbed: {why}", file=sys.stderr)
                return 1
            shaping = Shaping(args.rate, args.burst, args.latency) if args.rate else None
            bed = Bed.create(args.hosts, shaping=shaping, subnet=args.subnet, mtu=args.mtu, name=args.name)
            _print_bed(bed)
            h = bed.hosts[-1]
            print(f"\nrun on {h.name}:  python -m tests.hosts.netbed exec {args.name} {h.name} -- COMMAND")
            print(f"             or:  {shlex.join(bed.argv(h, ['COMMAND']))}")
            print(f"remove it:        python -m tests.hosts.netbed down {args.name}")
        elif args.cmd == "down":
            stale = sweep()
            for name in stale:
                print(f"removed {name} (its owner is gone)")
            beds = _bed_names()
            for name in args.name or [b for b in beds if _owner(b) is None]:
                full = name if name.startswith(PREFIX) else f"{PREFIX}{name}"
                if full not in beds:
                    raise BedError(f"no bed named {name!r} (python -m tests.hosts.netbed ls lists them)")
                # (by its namespaces, not attach: a half-made or half-removed bed goes too)
                if problems := _remove_namespaces(beds[full]):
                    raise BedError(f"bed {full}: " + "; ".join(problems))
                print(f"removed {full}")
        elif args.cmd == "ls":
            beds = sorted(_bed_names())
            for name in beds:
                _print_bed(Bed.attach(name))
            if not beds:
                print("no beds")
        elif args.cmd == "shape":
            bed = Bed.attach(args.name)
            if not args.off and not args.rate:
                parser.error("shape: give --rate, or --off")
            shaping = None if args.off else Shaping(args.rate, args.burst, args.latency)
            for host in [bed.host(args.host)] if args.host else bed.hosts:
                bed.shape(host, shaping)
            _print_bed(bed)
        elif args.cmd == "link":
            bed = Bed.attach(args.name)
            (bed.link_down if args.state == "down" else bed.link_up)(bed.host(args.host))
        elif args.cmd == "exec":
            bed = Bed.attach(args.name)
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                parser.error("exec: give the command after --")
            return subprocess.call(bed.argv(bed.host(args.host), command))
    except (BedError, ValueError) as exc:
        print(f"netbed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
