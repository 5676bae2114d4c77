"""From ``init_method`` / environment / launcher variables to (store, rank, world_size).

Forms understood (torch's, plus the variables of other launchers):

- ``None`` / ``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; when RANK/WORLD_SIZE are
  unset, OMPI_COMM_WORLD_RANK/SIZE (mpirun), PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS.
  Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank joins the store torchrun's
  agent hosts there, one namespace per restart (``aiodist.rendezvous.torchelastic``).
- ``tcp://host:port``: a TCPStore at host:port, hosted by rank 0 (or, with ``rank=-1``,
  by whichever process binds the port first).
- ``tcp://<multicast group>:port``: the legacy form; ranks find each other over UDP
  multicast and are assigned automatically; rank 0 hosts the store.
- ``file:///abs/path``: a FileStore on a shared file.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import ipaddress
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qs, urlparse

from aiodist.errors import DistStoreError, DistValueError
from aiodist.rendezvous import torchelastic as _torchelastic
from aiodist.runtime.progress import every
from aiodist.settings import Settings
from aiodist.store import FileStore, PrefixStore, Store, TCPStore
from aiodist.store.base import PORT_ADVICE, ForeignStoreError
from aiodist.transport.mesh import namespace

log = logging.getLogger("aiodist")

# The store namespace this process last used at each store address (see ``job_namespace``).
_last_namespace: dict[str, str] = {}

# How long a would-be store host whose port is taken tries to reach whatever holds it, to tell
# a store it may join (another job sharing the address) from another program.
PROBE_SECONDS = 5.0

__all__ = ["Rendezvous", "job_namespace", "local_address_towards", "resolve_rendezvous", "while_current"]

T = TypeVar("T")


@dataclass
class Rendezvous:
    """What rendezvous produced: a store, this process's rank (-1: assign one) and the world size."""

    store: Store
    rank: int
    world_size: int
    owns_store: bool  # we created it: close it on destroy
    master_addr: str | None  # where the job meets; decides which interface peers listen on
    # The key peers authenticate with when AIODIST_SECRET is unset (None: none), drawn through
    # the store by the rendezvous: under torchrun (see ``torchelastic.peer_secret``).
    secret: bytes | None = None
    # The store, named alike by every init of this process that meets the same store (None:
    # name it by its address or path): ``job_namespace`` remembers each one's last namespace.
    where: str | None = None
    # Runs beside the rest of the rendezvous, and raises if the rendezvous can no longer
    # complete (torchrun's nodes in different restart attempts): see ``while_current``.
    watch: Callable[[], Awaitable[None]] | None = None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def interface_address(name: str, where: str) -> str:
    """The IPv4 address of network interface ``name`` (``where`` names the setting, for errors).

    Raises:
        DistValueError: no such interface (the message lists them), or it has no IPv4 address.
    """
    names = interface_names()
    if name not in names:
        raise DistValueError(
            f"{where}: this machine has no network interface {name!r} (it has: {', '.join(names)}); "
            "give an interface name or an IP address of this machine"
        )
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError as exc:
        raise DistValueError(
            f"{where}: network interface {name!r} has no IPv4 address ({exc.strerror})"
        ) from None
    return socket.inet_ntoa(packed[20:24])


def _listen_override(settings: Settings) -> str | None:
    """``AIODIST_HOST`` (an address, a host name or an interface name), else ``GLOO_SOCKET_IFNAME``."""
    value = settings.listen_host
    if value:
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
        if value in interface_names():
            return interface_address(value, f"AIODIST_HOST={value}")
        try:
            socket.getaddrinfo(value, None, socket.AF_INET)
        except (socket.gaierror, UnicodeError):
            raise DistValueError(
                f"AIODIST_HOST={value}: neither an IP address, a network interface of this machine "
                f"({', '.join(interface_names())}) nor a host name that resolves"
            ) from None
        return value
    ifname = settings.socket_ifname
    if ifname:
        # gloo accepts a comma-separated list (one device each); aiodist listens on one address.
        first = ifname.split(",")[0].strip()
        return interface_address(first, f"GLOO_SOCKET_IFNAME={ifname}")
    return None


def local_address_towards(host: str, settings: Settings | None = None) -> str:
    """The address of this machine's interface that routes to ``host`` (loopback stays loopback).

    ``AIODIST_HOST`` (an address, host name or interface name such as ``eth0``) overrides it,
    else ``GLOO_SOCKET_IFNAME`` (an interface name, as gloo reads it).

    Raises:
        DistValueError: an interface named there does not exist or has no IPv4 address.
    """
    override = _listen_override(Settings.read() if settings is None else settings)
    if override:
        return override
    if is_loopback(host):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _port(value: str | int | None, where: str) -> int:
    try:
        port = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DistValueError(f"{where}: port {value!r} is not an integer") from None
    if not 0 <= port < 65536:
        raise DistValueError(f"{where}: port {port} is out of range")
    return port


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _tcp_store(
    host: str, port: int, world_size: int, rank: int, timeout: float, settings: Settings
) -> Store:
    """Rank 0 (or a process whose rank is yet unknown) hosts the store; others connect.

    A would-be host that finds the port taken probes what holds it (``PROBE_SECONDS`` at most):
    an aiodist store that accepts our secret is joined as a client (that is how several jobs
    with different group names share one address); anything else is an error naming the
    address. Either way the store (server or client) is this process's to close on destroy.
    """
    size = world_size if world_size > 0 else None
    addr = _addr(host, port)
    who = "a process" if rank == -1 else f"rank {rank}"
    if rank in (0, -1):
        master = TCPStore(host, port, size, is_master=True, timeout=timeout)
        try:
            await master.start()
            log.info("aiodist: %s hosts the store at %s", who, addr)
            return master
        except (DistStoreError, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc, DistStoreError) else exc
            code = cause.errno if isinstance(cause, OSError) else None
            await master.aclose()
            if code == errno.EADDRINUSE:
                return await _join_taken_port(host, port, size, rank, timeout, exc)
            if code != errno.EADDRNOTAVAIL:
                raise
            if rank == 0:
                raise DistStoreError(
                    f"rank 0 cannot host the store at {addr}: {host} is not an address of this machine "
                    "(rank 0 hosts the store at MASTER_ADDR: run rank 0 on that host, or set MASTER_ADDR "
                    "to one of its addresses)"
                ) from exc
            # rank -1 on another host than MASTER_ADDR: another process hosts the store there.
    client = TCPStore(host, port, size, is_master=False, timeout=timeout)
    try:
        report = functools.partial(_log_store_wait, who, addr, client=client)
        async with every(report, settings.rendezvous_log_interval):
            await client.start()
    except ForeignStoreError as exc:
        raise _in_use_error(who, "join", exc) from None
    log.info("aiodist: %s joined the store at %s", who, addr)
    return client


async def _join_taken_port(
    host: str, port: int, size: int | None, rank: int, timeout: float, cause: BaseException
) -> Store:
    """The would-be host's port is taken: join what holds it if it is an aiodist store of ours."""
    addr = _addr(host, port)
    who = "a process" if rank == -1 else f"rank {rank}"
    probe = TCPStore(host, port, size, is_master=False, timeout=min(timeout, PROBE_SECONDS))
    try:
        await probe.start()
    except ForeignStoreError as exc:
        raise _in_use_error(who, "host", exc) from None
    except DistStoreError as exc:
        raise DistStoreError(
            f"{who} cannot host the store at {addr}: the address is already in use by another program "
            f"(binding it failed, and nothing there accepted a connection within {min(timeout, PROBE_SECONDS):g} s); "
            f"{PORT_ADVICE}"
        ) from exc
    probe.set_timeout(timeout)
    log.info(
        "aiodist: %s found %s taken by an aiodist store that accepts this job's secret: joining it "
        "(jobs sharing one address are kept apart by group_name)",
        who,
        addr,
    )
    return probe


def _in_use_error(who: str, role: str, exc: ForeignStoreError) -> ForeignStoreError:
    """``exc`` restated from the rendezvous' point of view: who failed, hosting or joining."""
    verb = "cannot host" if role == "host" else "cannot join"
    if exc.holder == "program":
        msg = (
            f"{who} {verb} the store at {exc.addr}: the address is already in use by another program "
            f"({exc.why}; not an aiodist store); {PORT_ADVICE}"
        )
    elif role == "host":
        msg = (
            f"{who} {verb} the store at {exc.addr}: the address is already in use by another aiodist job "
            f"(its store refused this job's AIODIST_SECRET: a different secret); {PORT_ADVICE}"
        )
    else:
        msg = (
            f"{who} {verb} the store at {exc.addr}: it refused this process's AIODIST_SECRET (authentication "
            f"failed). Another aiodist job (with a different AIODIST_SECRET) holds {exc.addr}: then "
            f"{PORT_ADVICE}; or else this process's AIODIST_SECRET differs from rank 0's"
        )
    return ForeignStoreError(msg, addr=exc.addr, holder=exc.holder, why=exc.why)


def _log_store_wait(who: str, addr: str, waited: float, *, client: TCPStore) -> None:
    last = client.last_connect_error
    log.warning(
        "aiodist: %s has waited %.0f s for the store at %s (rank 0 hosts it: is rank 0 running, with the "
        "same MASTER_ADDR/MASTER_PORT?); last error: %s",
        who,
        waited,
        addr,
        "none" if last is None else f"{last.__class__.__name__}: {last}",
    )


async def resolve_rendezvous(
    init_method: str | None,
    *,
    rank: int,
    world_size: int,
    timeout: float,
    store: Store | None,
    settings: Settings,
) -> Rendezvous:
    """Turn the arguments of ``init_process_group`` into a store and a (maybe unassigned) rank."""
    if store is not None:
        if init_method is not None:
            raise DistValueError("init_process_group: pass either init_method or store, not both")
        rank, world_size = settings.rank_and_size(rank, world_size)
        if world_size <= 0 or rank == -1:
            raise DistValueError(
                "init_process_group(store=...) needs rank and world_size (or RANK/WORLD_SIZE)"
            )
        _check_rank(rank, world_size, assignable=False)
        return Rendezvous(store, rank, world_size, owns_store=False, master_addr=settings.master_addr)

    url = urlparse(init_method or "env://")
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    if "rank" in query and rank == -1:
        rank = int(query["rank"])
    if "world_size" in query and world_size == -1:
        world_size = int(query["world_size"])

    if url.scheme == "env":
        rank, world_size = settings.rank_and_size(rank, world_size)
        for name, value in (("MASTER_ADDR", settings.master_addr), ("MASTER_PORT", settings.master_port)):
            if value is None:
                raise DistValueError(f"init_method env:// needs the environment variable {name}")
        host, port = str(settings.master_addr), _port(settings.master_port, "MASTER_PORT")
        _need_world_size(world_size, "env://")
        if rank == -1:
            raise DistValueError(
                "init_method env:// needs RANK (or rank=, or an mpirun/PMI/Slurm rank variable)"
            )
        _check_rank(rank, world_size, assignable=False)
        if settings.agent_store:
            agent = await _torchelastic.join_agent_store(host, port, rank, timeout, settings)
            drawn = None if settings.secret else await _torchelastic.peer_secret(agent.store)
            log.info(
                "aiodist: rank %d joined the store torchrun hosts at %s (restart attempt %d)%s",
                rank,
                _addr(host, port),
                agent.attempt,
                "; no AIODIST_SECRET: peers authenticate with a key drawn through that store"
                if drawn
                else "",
            )
            watch = functools.partial(
                _torchelastic.watch_attempt, agent.job, agent.attempt, rank, settings.node_rank
            )
            return Rendezvous(agent.store, rank, world_size, True, host, drawn, agent.where, watch)
        st = await _tcp_store(host, port, world_size, rank, timeout, settings)
        return Rendezvous(st, rank, world_size, True, host)

    if url.scheme == "tcp":
        host = url.hostname or ""
        port = _port(url.port, init_method or "")
        if not host:
            raise DistValueError(f"init_method {init_method!r} has no host")
        _need_world_size(world_size, init_method or "")
        _check_rank(rank, world_size, assignable=True)
        from aiodist.rendezvous import multicast as _multicast

        if _multicast.is_multicast_address(host):
            found = await _multicast.discover(host, port, world_size, timeout=timeout, settings=settings)
            if rank not in (-1, found.rank):
                raise DistValueError(
                    f"multicast rendezvous assigns ranks itself (got rank {found.rank}); pass rank=-1, not {rank}"
                )
            st2 = TCPStore(
                found.master_addr,
                found.master_port,
                world_size,
                is_master=found.listen_sock is not None,
                timeout=timeout,
                sock=found.listen_sock,
            )
            await st2.start()
            return Rendezvous(st2, found.rank, world_size, True, found.master_addr)
        st = await _tcp_store(host, port, world_size, rank, timeout, settings)
        return Rendezvous(st, rank, world_size, True, host)

    if url.scheme == "file":
        path = url.path
        if not path:
            raise DistValueError(f"init_method {init_method!r} has no path")
        _need_world_size(world_size, init_method or "")
        _check_rank(rank, world_size, assignable=True)
        fst = FileStore(path, world_size)
        fst.set_timeout(timeout)
        return Rendezvous(fst, rank, world_size, True, None)

    raise DistValueError(
        f"init_method {init_method!r}: unknown scheme {url.scheme!r} (use env://, tcp:// or file://)"
    )


async def job_namespace(rdv: Rendezvous, group_name: str, timeout: float) -> Store:
    """This init's namespace in the rendezvous store, as a ``PrefixStore`` (see ``mesh.namespace``).

    Remembers, per store address, the namespace this process used, so that a rank meeting the
    previous init's store waits for the next init instead of joining the old one.

    Raises:
        DistValueError: rank 0 joined another job's store that already holds ``group_name``.
        DistTimeoutError: rank 0 did not open the namespace in time.
    """
    st = rdv.store
    if rdv.where is not None:
        where = f"{rdv.where} {group_name}"
    elif isinstance(st, TCPStore):
        where = f"tcp {st.host}:{st.port} {group_name}"
    else:
        where = f"{type(st).__name__} {getattr(st, 'path', id(st))} {group_name}"
    fresh = rdv.owns_store and isinstance(st, TCPStore) and st.server is not None
    if rdv.rank == 0 and rdv.owns_store and isinstance(st, TCPStore) and not fresh:
        # Rank 0 found its port held by an aiodist store that accepts our secret (jobs with
        # different group names may share one address): is our group name free there?
        key = f"aiodist/{group_name}/namespace"
        if await st.check([key]) and (await st.get(key)).decode() != _last_namespace.get(where):
            raise DistValueError(
                f"rendezvous failed: rank 0 found {st.host}:{st.port} held by another aiodist job's store "
                f"(same AIODIST_SECRET) with a rendezvous under the same group name {group_name!r}: "
                "choose another port, or another group_name"
            )
    name = await namespace(
        st,
        group_name,
        rdv.rank,
        rdv.world_size,
        fresh=fresh,
        last=_last_namespace.get(where),
        timeout=timeout,
    )
    _last_namespace[where] = name
    return PrefixStore(name, st)


async def while_current(rdv: Rendezvous, work: Awaitable[T]) -> T:
    """Await ``work`` (the rest of the rendezvous through ``rdv``) while ``rdv.watch`` lets it.

    Raises:
        What ``work`` raises; or, when the watch raises first (or ``work`` failed because of
        what the watch then reports), the watch's error, ``work`` cancelled.
    """
    if rdv.watch is None:
        return await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(rdv.watch())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and task.exception() is None:
            return task.result()  # every rank met: whatever the watch says came too late to matter
        if task.done():
            # The rendezvous failed: say so, unless the watch (given two of its turns) knows why.
            await asyncio.wait({watch}, timeout=2 * _torchelastic.WATCH_INTERVAL)
            if not watch.done():
                return task.result()  # raises the rendezvous' error
        watch.result()  # raises the watch's error (it never returns)
        raise AssertionError("a rendezvous watch returned")
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


def _check_rank(rank: int, world_size: int, *, assignable: bool) -> None:
    """Refuse a rank outside 0..world_size-1 before any store is hosted or waited for (such a
    rank could only wait for the rendezvous to time out). ``assignable``: -1 asks for a rank
    in arrival order (tcp://, file://).

    Raises:
        DistValueError: naming the rank and the world size.
    """
    if (assignable and rank == -1) or 0 <= rank < world_size:
        return
    ranks = "0" if world_size == 1 else f"0 to {world_size - 1}"
    also = ", or -1 to be assigned one in arrival order" if assignable else ""
    raise DistValueError(
        f"init_process_group: rank {rank} is out of range for world_size {world_size} "
        f"(the ranks are {ranks}{also})"
    )


def _need_world_size(world_size: int, where: str) -> None:
    if world_size <= 0:
        raise DistValueError(
            f"init_method {where} needs world_size (argument, WORLD_SIZE or a launcher variable)"
        )
