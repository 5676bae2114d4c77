"""``OpContext``: everything an algorithm sees of one collective operation.

Peers are addressed by their rank *in the group*; the context maps them to global ranks
and stamps every message with the operation's key (group, sequence number) and
fingerprint, so concurrent operations never see each other's data and ranks that disagree
about the operation are caught when their data meets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiodist._tensors import byte_view
from aiodist.collectives.topology import HostMap, host_map
from aiodist.transport.base import Fingerprint, Key, Transport

__all__ = ["OpContext", "byte_view"]


class OpContext:
    """One collective operation as seen by the algorithm running it on this rank.

    Attributes:
        rank: this process's rank in the group.
        size: the group's size.
        loop: the event loop the operation runs on.
        hosts: the group's ranks by host, equal on every rank (None: no host facts).
    """

    __slots__ = ("fp", "hosts", "key", "loop", "rank", "ranks", "size", "transport")

    def __init__(
        self, transport: Transport, ranks: Sequence[int], rank: int, key: Key, fp: Fingerprint | None
    ) -> None:
        self.transport = transport
        self.ranks = ranks
        self.rank = rank
        self.size = len(ranks)
        self.key = key
        self.fp = fp
        self.loop = transport.loop
        # The group's ranks by host, equal on every rank (None: the transport knows no hosts).
        self.hosts: HostMap | None = host_map(transport.host_keys, ranks)

    def send(self, peer: int, buf: memoryview) -> asyncio.Future[None]:
        """Queue ``buf`` for group rank ``peer`` now; await it before reusing ``buf``."""
        return self.transport.send(self.ranks[peer], self.key, buf, self.fp)

    def recv(self, peer: int, buf: memoryview) -> asyncio.Future[int]:
        """Post a receive of exactly ``buf.nbytes`` bytes from group rank ``peer`` into ``buf``."""
        return self.transport.recv(self.ranks[peer], self.key, buf, self.fp)

    # -- host facts (aiodist.collectives.hostaware) ----------------------------------------
    def shares_memory(self) -> bool:
        """Every member reaches every other member of its host through shared memory (from the
        facts the ranks agreed on at rendezvous, so every member answers the same)."""
        shm = self.transport.shm_local
        return shm is not None and all(shm[g] for g in self.ranks)

    def sub(self, members: Sequence[int]) -> OpContext:
        """The same operation among group ranks ``members`` only (this rank must be one of them).

        The sub-operation keeps the operation's key and fingerprint: its messages are told from
        the other phases' by their order, which each pair of ranks keeps.
        """
        return self.among(tuple(self.ranks[m] for m in members), list(members).index(self.rank))

    def among(self, ranks: Sequence[int], rank: int) -> OpContext:
        """This operation's context among global ``ranks``, this process being ``rank`` of them
        (``sub``; a subclass keeps what it adds)."""
        return OpContext(self.transport, ranks, rank, self.key, self.fp)
