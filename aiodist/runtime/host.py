"""What this host offers the ranks running on it: cores, how many ranks share them, and which host it is."""

from __future__ import annotations

import functools
import os
import socket

__all__ = ["HOST_ID_ENV", "cores", "has_core_per_rank", "has_spare_core", "host_key", "local_ranks"]

#: Set per rank to make it count as being on another host (tests of the multi-host paths on one machine).
HOST_ID_ENV = "AIODIST_HOST_ID"


@functools.cache
def cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def local_ranks() -> int:
    """Ranks on this host: ``LOCAL_WORLD_SIZE`` (set by the launchers), else ``WORLD_SIZE``, else 1.

    Local knowledge only: ranks need not agree on anything derived from it.
    """
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1))
    except ValueError:
        return 1


def has_core_per_rank() -> bool:
    """Every rank of this host can have a core to itself (so polling takes nobody's core)."""
    return cores() >= local_ranks()


def has_spare_core() -> bool:
    """There is a core beyond one per rank (so a worker thread runs beside every loop)."""
    return cores() > local_ranks()


def host_key() -> str:
    """Which machine this process runs on, as a string equal for exactly the processes of one host.

    ``AIODIST_HOST_ID`` when set (a rank given another value counts as being on another host),
    else the host name and the kernel's boot id: two containers or machines that share a host
    name still differ by boot id, and a reboot makes a new key. Read at each call.
    """
    forced = os.environ.get(HOST_ID_ENV, "").strip()
    if forced:
        return f"id:{forced}"
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the host name alone
        boot = ""
    return f"{socket.gethostname()}/{boot}"
