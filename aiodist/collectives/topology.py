"""Which ranks of a group share a host: the host map every host-aware algorithm plans with.

The transport holds every global rank's host key, the same tuple on every rank (the mesh
agrees on it at rendezvous); a group's map is derived from it and the group's ranks alone,
so every member computes the same map, and a subgroup whose ranks span hosts gets its own.
Hosts are numbered in the order of their lowest group rank, and that rank is the host's
leader: the one that talks to the other hosts in the hierarchical algorithms.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostMap", "host_map"]


@dataclass(frozen=True, slots=True)
class HostMap:
    """A group's ranks by host.

    Attributes:
        host_of: group rank -> host index.
        members: host index -> its group ranks, ascending (``members[h][0]`` is its leader).
    """

    host_of: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]

    @property
    def n_hosts(self) -> int:
        return len(self.members)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest group rank of each host, in host order."""
        return tuple(m[0] for m in self.members)

    @property
    def one_host(self) -> bool:
        """Every rank of the group shares one host."""
        return len(self.members) == 1

    @property
    def layered(self) -> bool:
        """More than one host, and more than one rank on some host: a hierarchy pays."""
        return 1 < len(self.members) < len(self.host_of)

    @property
    def uniform(self) -> bool:
        """Every host has as many of the group's ranks as every other."""
        return len({len(m) for m in self.members}) == 1

    def contiguous(self) -> bool:
        """Each host's ranks are a contiguous range (then host order is rank order)."""
        return all(m[-1] - m[0] + 1 == len(m) for m in self.members)


def host_map(keys: tuple[str, ...] | None, ranks: Sequence[int]) -> HostMap | None:
    """The host map of the group of global ``ranks`` given every global rank's host key (None:
    unknown, so no host-aware algorithm runs)."""
    if keys is None:
        return None
    return _host_map(keys, tuple(ranks))


@functools.lru_cache(maxsize=512)
def _host_map(keys: tuple[str, ...], ranks: tuple[int, ...]) -> HostMap:
    index: dict[str, int] = {}
    host_of: list[int] = []
    members: list[list[int]] = []
    for g, r in enumerate(ranks):
        h = index.setdefault(keys[r], len(members))
        if h == len(members):
            members.append([])
        members[h].append(g)
        host_of.append(h)
    return HostMap(tuple(host_of), tuple(tuple(m) for m in members))
