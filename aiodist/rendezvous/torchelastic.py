"""``env://`` under torchrun: join the store torchrun's agent hosts, one namespace per restart.

torchrun (``torch.distributed.run``) hosts torch's own c10d ``TCPStore`` at
MASTER_ADDR:MASTER_PORT before it starts the workers, keeps it for every restart of the worker
group, and tells the workers with ``TORCHELASTIC_USE_AGENT_STORE=True``. That port is torch's:
no rank may host an aiodist store there, and aiodist's store protocol is not torch's. So every
rank joins it as a client, through torch (imported here, lazily), as torch's own ``env://``
does, and keeps aiodist's keys under ``aiodist/attempt_<TORCHELASTIC_RESTART_COUNT>``: the keys
of an earlier attempt stay in the store, and a restarted worker group must never read them.
Where nodes disagree on the attempt (see ``watch_attempt``), the ranks behind fail at once and
torchrun's next restart brings the nodes in step.

torch's store has no authentication. Unless ``AIODIST_SECRET`` is set, the peers of one
attempt authenticate with a key the first rank to arrive draws and leaves in the attempt's
namespace (``peer_secret``): it keeps jobs and attempts apart and turns away whoever has not
read the store; it is no stronger than access to torchrun's store port.
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
from dataclasses import dataclass
from typing import Any

from aiodist.errors import DistError, DistStoreError
from aiodist.settings import Settings
from aiodist.store import PrefixStore, Store
from aiodist.store.c10d import TorchStore, first_line

__all__ = [
    "AGENT_STORE_VAR",
    "RESTART_VAR",
    "AgentStore",
    "announce_attempt",
    "behind_error",
    "join_agent_store",
    "peer_secret",
    "watch_attempt",
]

#: Set to "True" by torchrun's agent when it hosts the job's store (torch's own test, verbatim).
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
#: How many times torchrun's agent restarted this node's worker group before this attempt.
RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"


def _torch_tcp_store_class(who: str, addr: str) -> Any:
    """torch's ``TCPStore`` class, or an error saying why this process cannot use torchrun's store."""
    joining = (
        f"{who} cannot join the store at {addr}: torchrun hosts torch's own store there "
        f"({AGENT_STORE_VAR}=True), and joining it needs torch"
    )
    remedy = (
        "install torch in this environment (pip install 'aiodist[torch]'), or launch with aiodist-run, "
        "whose workers meet in aiodist's own store"
    )
    try:
        import torch.distributed as td
    except ImportError as exc:
        raise DistStoreError(f"{joining}, which this Python cannot import ({exc}): {remedy}") from exc
    if not td.is_available():
        raise DistStoreError(f"{joining} built with distributed support, which this one is not: {remedy}")
    from torch._C._distributed_c10d import TCPStore

    return TCPStore


@dataclass(frozen=True)
class AgentStore:
    """This worker's view of torchrun's store."""

    attempt: int  # TORCHELASTIC_RESTART_COUNT
    store: Store  # the attempt's namespace: the rendezvous happens here
    job: Store  # the job's namespace, every attempt's: the attempts the job's workers reached
    where: str  # the same for every init of this process against this attempt (see ``job_namespace``)


async def join_agent_store(host: str, port: int, rank: int, timeout: float, settings: Settings) -> AgentStore:
    """Connect to torchrun's store at ``host:port`` as a client.

    Raises:
        DistStoreError: torch cannot be imported, or the store did not answer within ``timeout``.
        DistValueError: ``TORCHELASTIC_RESTART_COUNT`` is not a count.
    """
    attempt = settings.restart_attempt()
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    who = f"rank {rank}"
    tcp_store = _torch_tcp_store_class(who, addr)
    delta = datetime.timedelta(seconds=timeout)

    def connect() -> Any:
        # A client only (is_master=False), as torch's own env:// under torchrun; the agent's store
        # counts no workers (wait_for_workers=False leaves its keys alone).
        return tcp_store(host, port, None, False, delta, wait_for_workers=False)

    try:
        client = await asyncio.to_thread(connect)
    except Exception as exc:  # torch's DistNetworkError, or a RuntimeError of its validation
        raise DistStoreError(
            f"{who} cannot join torchrun's store at {addr} (attempt {attempt}): {first_line(exc)}"
        ) from None
    job = PrefixStore("aiodist", TorchStore(client, timeout))
    return AgentStore(
        attempt, PrefixStore(f"attempt_{attempt}", job), job, f"torchrun {addr} attempt {attempt}"
    )


async def peer_secret(store: Store) -> bytes:
    """The key the peers of this attempt authenticate with: drawn by the first rank to ask.

    Every rank offers a fresh random key; the store keeps the first and returns it to all.
    """
    drawn = secrets.token_hex(32)
    return await store.compare_set("peer_secret", "", drawn)


# -- nodes that disagree on the attempt -----------------------------------------------------------
#
# torchrun's agents count restarts each for itself: an agent whose own workers failed counts one,
# an agent that only stops its healthy workers because another node re-joined the rendezvous
# does not. The nodes of one worker group can then be in different attempts, and their ranks
# would wait in different namespaces until the rendezvous timed out; on the next restart both
# count again and stay apart. Attempts only grow, and every worker of an earlier worker group
# is stopped before a later group starts, so a worker that finds a later attempt recorded in the
# job's namespace is behind: it fails at once, its agent counts a restart and re-joins, and the
# other agents restart their workers without counting: the next group is in step.

_LATEST = "latest_attempt"
WATCH_INTERVAL = 0.5


async def announce_attempt(job: Store, attempt: int) -> int:
    """Record that a worker of ``attempt`` started; the latest attempt any worker of the job reached."""
    expected = ""
    while True:
        got = (await job.compare_set(_LATEST, expected, str(attempt))).decode(errors="replace")
        latest = int(got) if got.isdigit() else -1
        if latest >= attempt:
            return latest
        expected = got  # an earlier attempt (or nonsense): replace it with ours


def behind_error(rank: int, attempt: int, latest: int, node: int | None = None) -> DistError:
    where = f"rank {rank}" + (f" (node {node})" if node is not None else "")
    return DistError(
        f"rendezvous failed: {where} is in torchrun's restart attempt {attempt}, and another node's "
        f"workers already reached attempt {latest}: torchrun's agents count restarts each for itself "
        "(an agent that stops its healthy workers for another node's restart does not count one). "
        "This worker fails so that its agent counts a restart and starts the next attempt in step "
        "with the other nodes (--max-restarts must allow it)"
    )


async def watch_attempt(job: Store, attempt: int, rank: int, node: int | None = None) -> None:
    """Return never; raise ``behind_error`` once a later attempt than ``attempt`` is recorded.

    A store that fails ends the watching, not the rendezvous (which meets the failure itself).
    """
    try:
        latest = await announce_attempt(job, attempt)
        while latest <= attempt:
            await asyncio.sleep(WATCH_INTERVAL)
            got = await job.get(_LATEST) if await job.check([_LATEST]) else b""
            latest = int(got) if got.isdigit() else latest
    except DistError:
        await asyncio.get_running_loop().create_future()  # never done: cancelled with the rendezvous
    raise behind_error(rank, attempt, latest, node)
