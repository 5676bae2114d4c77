"""Where the ranks of a launched job run: each rank's host, the job's placement, the network
interface that reaches the other hosts, and the address rank 0 can be reached at.

A rank's host is aiodist's own idea of it (``runtime.host.host_id``: ``AIODIST_HOST_ID``, else
the host name and boot id), since that is what decides whether aiodist moves data between two
ranks through shared memory or over the network. Ranks of one host id that listen on different
addresses are network namespaces of one machine (a test bed of "hosts" linked by veth pairs):
aiodist counts them as one host, and the placement says so.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from aiodist.rendezvous import interface_address, interface_names, is_loopback, local_address_towards
from aiodist.runtime.host import host_id

__all__ = [
    "choose_master_address",
    "describe_hosts",
    "gloo_interface",
    "ipv4_networks",
    "network_identity",
    "placement",
    "rank_host",
]

_SIOCGIFNETMASK = 0x891B  # Linux: the IPv4 netmask of an interface


def ipv4_networks() -> list[tuple[str, str]]:
    """(interface, ``address/prefix``) of every interface of this machine with an IPv4 address."""
    out: list[tuple[str, str]] = []
    for name in interface_names():
        try:
            addr = interface_address(name, name)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, struct.pack("256s", name.encode()[:15]))
        except (ValueError, OSError):  # no IPv4 address (DistValueError is a ValueError)
            continue
        mask = socket.inet_ntoa(packed[20:24])
        out.append((name, str(ipaddress.IPv4Interface(f"{addr}/{mask}"))))
    return out


def network_identity() -> str:
    """This process's network stack: the kernel it runs on and its network namespace; processes
    with equal identities reach each other on 127.0.0.1. (``AIODIST_HOST_ID`` plays no part: it
    changes what aiodist calls a host, not where a socket can connect.)"""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
    except OSError:
        kernel = socket.gethostname()
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return f"{kernel} netns {netns}"


def gloo_interface(master_addr: str, environ: Mapping[str, str]) -> tuple[str, str]:
    """The interface gloo should use (``GLOO_SOCKET_IFNAME``) and how it was chosen.

    The user's ``GLOO_SOCKET_IFNAME`` is kept; otherwise the interface that holds the address
    aiodist listens on (the route to ``master_addr``, or ``AIODIST_HOST``), ``lo`` on loopback.

    Raises:
        ValueError: no interface of this machine holds that address (say which to use with
            ``GLOO_SOCKET_IFNAME``).
    """
    given = environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if given:
        return given, "set by the user"
    addr = local_address_towards(master_addr)
    if is_loopback(addr):
        names = interface_names()
        return ("lo" if "lo" in names else names[0]), f"loopback, as MASTER_ADDR={master_addr}"
    for name, net in ipv4_networks():
        if net.split("/")[0] == addr:
            return name, f"the interface of {addr}, the route to MASTER_ADDR={master_addr}"
    raise ValueError(
        f"no network interface of this machine holds {addr}, the address towards MASTER_ADDR="
        f"{master_addr}: set GLOO_SOCKET_IFNAME to the interface that reaches the other hosts"
    )


def rank_host(rank: int, master_addr: str, local_rank: int | None, gloo_ifname: str | None) -> dict[str, Any]:
    """This rank's record: where it runs and which address it listens on."""
    return {
        "rank": rank,
        "local_rank": local_rank,
        "hostname": socket.gethostname(),
        "host": host_id(),
        "address": local_address_towards(master_addr),
        "network": network_identity(),
        "gloo_ifname": gloo_ifname,
        "pid": os.getpid(),
    }


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3,6``: a sorted list of ranks, consecutive runs shortened."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(
            f"{start}-{prev}" if prev > start + 1 else f"{start},{prev}" if prev > start else f"{start}"
        )
        if r is not None:
            start = prev = r
    return ",".join(out)


def placement(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The job's hosts from every rank's ``rank_host`` record (in rank order).

    Returns ``hosts`` (per host: its id, host name, the addresses and gloo interfaces its ranks
    use, its ranks), ``text`` (``2 hosts x 2 ranks``; ``2 hosts (3+1 ranks)`` when uneven) and
    ``notes`` (what a reader of the figures must know, e.g. network namespaces of one machine).
    """
    hosts: dict[str, dict[str, Any]] = {}
    for rec in records:
        h = hosts.setdefault(
            rec["host"],
            {
                "host": rec["host"],
                "hostname": rec["hostname"],
                "addresses": [],
                "gloo_ifnames": [],
                "ranks": [],
            },
        )
        h["ranks"].append(rec["rank"])
        if rec["address"] not in h["addresses"]:
            h["addresses"].append(rec["address"])
        if rec.get("gloo_ifname") and rec["gloo_ifname"] not in h["gloo_ifnames"]:
            h["gloo_ifnames"].append(rec["gloo_ifname"])
    counts = [len(h["ranks"]) for h in hosts.values()]
    nh = len(hosts)
    if len(set(counts)) == 1:
        text = f"{nh} host{'s' if nh > 1 else ''} x {counts[0]} rank{'s' if counts[0] > 1 else ''}"
    else:
        text = f"{nh} hosts ({'+'.join(str(c) for c in counts)} ranks)"
    notes = []
    for h in hosts.values():
        networks = {rec["network"] for rec in records if rec["host"] == h["host"]}
        if len(networks) > 1:
            notes.append(
                f"ranks {_ranges(h['ranks'])} share host id {h['host']!r} but run in {len(networks)} network "
                f"namespaces (listening on {', '.join(h['addresses'])}): aiodist counts them as one host and "
                "may move their data through shared memory, not the network; give each namespace its own "
                "AIODIST_HOST_ID (or run with --aiodist-transports tcp) to measure the network"
            )
    for h in hosts.values():
        h["ranks_text"] = _ranges(h["ranks"])
    return {"hosts": list(hosts.values()), "text": text, "notes": notes}


def describe_hosts(place: Mapping[str, Any]) -> str:
    """One line: ``2 hosts x 2 ranks: a (10.0.0.1, gloo on veth0): ranks 0,1; b (...): ranks 2,3``."""
    parts = []
    names = [h["hostname"] for h in place["hosts"]]
    for h in place["hosts"]:
        # Hosts that share a name (network namespaces, containers) are told apart by their ids.
        name = h["hostname"] if names.count(h["hostname"]) == 1 else f"{h['hostname']} [{h['host']}]"
        where = ", ".join(h["addresses"])
        if h["gloo_ifnames"]:
            where += f", gloo on {'/'.join(h['gloo_ifnames'])}"
        parts.append(f"{name} ({where}): ranks {h['ranks_text']}")
    return f"{place['text']}: " + "; ".join(parts)


def choose_master_address(
    mine: Sequence[tuple[str, str]], identities: Sequence[str], others: Sequence[Sequence[tuple[str, str]]]
) -> str:
    """The address rank 0 hosts the rendezvous at, when no MASTER_ADDR was given.

    Args:
        mine: rank 0's ``ipv4_networks()``.
        identities: every rank's ``network_identity()`` (rank 0's first).
        others: every other rank's ``ipv4_networks()``.

    Returns 127.0.0.1 when every rank shares rank 0's network stack; else the first address of
    rank 0 (not loopback) whose network holds an address of every other rank.

    Raises:
        ValueError: no such address (the message says to set MASTER_ADDR).
    """
    if all(x == identities[0] for x in identities):
        return "127.0.0.1"
    for _, net in mine:
        iface = ipaddress.IPv4Interface(net)
        if iface.ip.is_loopback:
            continue
        if all(any(ipaddress.IPv4Interface(n).ip in iface.network for _, n in theirs) for theirs in others):
            return str(iface.ip)
    raise ValueError(
        "rank 0 has no address on a network that every other rank is on, so it cannot tell where the others "
        "reach it: set MASTER_ADDR to an address of rank 0's host that the other hosts reach "
        "(mpirun -x MASTER_ADDR=<address>)"
    )
