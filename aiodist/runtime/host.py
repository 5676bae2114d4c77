"""What this host offers the ranks running on it: cores, and how many ranks share them.

A host is what shares memory (``host_id``); a machine is what shares cores: one kernel
(``machine_id``, its boot id). Containers or network namespaces of one machine are hosts of
their own that share its cores, so whether a rank may take a core to itself depends on the
ranks of every host of its machine too (``note_ranks_on_machine``, told at rendezvous).
"""

from __future__ import annotations

import functools
import os
import socket

__all__ = [
    "cores",
    "has_core_per_rank",
    "has_spare_core",
    "host_id",
    "local_ranks",
    "machine_cores",
    "machine_id",
    "learn",
    "note_ranks_on_machine",
]

# Ranks of this job on this machine, every host of it (see the module docstring); 0: not known.
_ranks_on_machine = 0
# What the launcher and the settings say (``learn``, when a job starts): ranks on this host,
# and a host id forced by AIODIST_HOST_ID.
_local_ranks = 1
_forced_host_id = ""


def learn(local_ranks: int, forced_host_id: str) -> None:
    """Take what this job's settings say: ranks on this host (``LOCAL_WORLD_SIZE``, else
    ``WORLD_SIZE``) and ``AIODIST_HOST_ID`` (empty: none)."""
    global _local_ranks, _forced_host_id
    _local_ranks, _forced_host_id = max(1, local_ranks), forced_host_id


@functools.cache
def cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_ranks() -> int:
    """Ranks on this host: ``LOCAL_WORLD_SIZE`` (set by the launchers), else ``WORLD_SIZE``, else 1
    (as ``learn`` was told).

    Local knowledge only: ranks need not agree on anything derived from it.
    """
    return _local_ranks


def note_ranks_on_machine(n: int) -> None:
    """Learn how many ranks of the job run on this machine, on every host of it (rendezvous)."""
    global _ranks_on_machine
    _ranks_on_machine = n


def has_core_per_rank() -> bool:
    """Every rank of this host can have a core to itself (so polling takes nobody's core): its
    host's ranks fit its cores, and its machine's ranks (other hosts of it too) the machine's."""
    return cores() >= local_ranks() and _ranks_on_machine <= machine_cores()


def has_spare_core() -> bool:
    """There is a core beyond one per rank (so a worker thread runs beside every loop)."""
    return cores() > local_ranks() and _ranks_on_machine < machine_cores()


@functools.cache
def machine_cores() -> int:
    """The machine's cores (read once: ``os.cpu_count`` reads a file each time, and the blocking
    face asks on every call that may poll)."""
    return os.cpu_count() or 1


@functools.cache
def machine_id() -> str:
    """Which kernel this process runs under (its boot id; empty where the system does not say):
    the processes of one machine, whatever their containers or network namespaces."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_id() -> str:
    """Which host this process runs on, for telling ranks of one host from others.

    ``AIODIST_HOST_ID`` when set (a test can place ranks of one machine on "different hosts"
    with it), else the host name and the kernel's boot id (two containers with one host name
    and separate kernels, or a reused name after a reboot, differ). Ranks with equal ids still
    prove they share memory before they use it.
    """
    if _forced_host_id:
        return _forced_host_id
    boot = machine_id()
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()
