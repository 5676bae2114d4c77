"""From ``init_method`` / environment / launcher variables to (store, rank, world_size).

Forms understood (torch's, plus the variables of other launchers):

- ``None`` / ``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; when RANK/WORLD_SIZE are
  unset, OMPI_COMM_WORLD_RANK/SIZE (mpirun), PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS.
- ``tcp://host:port``: a TCPStore at host:port, hosted by rank 0 (or, with ``rank=-1``,
  by whichever process binds the port first).
- ``tcp://<multicast group>:port``: the legacy form; ranks find each other over UDP
  multicast and are assigned automatically; rank 0 hosts the store.
- ``file:///abs/path``: a FileStore on a shared file.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

from aiodist.errors import DistStoreError, DistValueError
from aiodist.store import FileStore, Store, TCPStore

__all__ = ["Rendezvous", "local_address_towards", "resolve_rendezvous"]


@dataclass
class Rendezvous:
    """What rendezvous produced: a store, this process's rank (-1: assign one) and the world size."""

    store: Store
    rank: int
    world_size: int
    owns_store: bool  # we created it: close it on destroy
    master_addr: str | None  # where the job meets; decides which interface peers listen on


_ENV_PAIRS = (
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise DistValueError(f"environment variable {name}={value!r} is not an integer") from None


def rank_and_size_from_env(rank: int, world_size: int) -> tuple[int, int]:
    """Fill in rank/world_size left at -1 from the first launcher's variables that are set."""
    for rank_var, size_var in _ENV_PAIRS:
        if rank == -1 and rank_var in os.environ:
            rank = _env_int(rank_var)
        if world_size == -1 and size_var in os.environ:
            world_size = _env_int(size_var)
        if rank != -1 and world_size != -1:
            break
    return rank, world_size


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address_towards(host: str) -> str:
    """The address of this machine's interface that routes to ``host`` (loopback stays loopback).

    ``AIODIST_HOST`` overrides it (multi-homed machines).
    """
    override = os.environ.get("AIODIST_HOST")
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


async def _tcp_store(host: str, port: int, world_size: int, rank: int, timeout: float) -> Store:
    """Rank 0 (or a process whose rank is yet unknown) hosts the store; others connect.

    A would-be host that finds the port taken joins as a client: that is how several jobs
    with different group names share one address. Either way the store (server or client)
    is this process's to close on destroy.
    """
    if rank in (0, -1):
        master = TCPStore(host, port, world_size if world_size > 0 else None, is_master=True, timeout=timeout)
        try:
            await master.start()
            return master
        except (DistStoreError, OSError) as exc:
            cause = exc.__cause__ if isinstance(exc, DistStoreError) else exc
            if not (isinstance(cause, OSError) and cause.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)):
                raise
            await master.aclose()
    client = TCPStore(host, port, world_size if world_size > 0 else None, is_master=False, timeout=timeout)
    await client.start()
    return client


async def resolve_rendezvous(
    init_method: str | None, *, rank: int, world_size: int, timeout: float, store: Store | None
) -> Rendezvous:
    """Turn the arguments of ``init_process_group`` into a store and a (maybe unassigned) rank."""
    if store is not None:
        if init_method is not None:
            raise DistValueError("init_process_group: pass either init_method or store, not both")
        rank, world_size = rank_and_size_from_env(rank, world_size)
        if world_size <= 0 or rank < 0:
            raise DistValueError(
                "init_process_group(store=...) needs rank and world_size (or RANK/WORLD_SIZE)"
            )
        return Rendezvous(
            store, rank, world_size, owns_store=False, master_addr=os.environ.get("MASTER_ADDR")
        )

    url = urlparse(init_method or "env://")
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    if "rank" in query and rank == -1:
        rank = int(query["rank"])
    if "world_size" in query and world_size == -1:
        world_size = int(query["world_size"])

    if url.scheme == "env":
        rank, world_size = rank_and_size_from_env(rank, world_size)
        try:
            host = os.environ["MASTER_ADDR"]
            port = _port(os.environ["MASTER_PORT"], "MASTER_PORT")
        except KeyError as exc:
            raise DistValueError(f"init_method env:// needs the environment variable {exc.args[0]}") from None
        _need_world_size(world_size, "env://")
        if rank < 0:
            raise DistValueError(
                "init_method env:// needs RANK (or rank=, or an mpirun/PMI/Slurm rank variable)"
            )
        st = await _tcp_store(host, port, world_size, rank, timeout)
        return Rendezvous(st, rank, world_size, True, host)

    if url.scheme == "tcp":
        host = url.hostname or ""
        port = _port(url.port, init_method or "")
        if not host:
            raise DistValueError(f"init_method {init_method!r} has no host")
        _need_world_size(world_size, init_method or "")
        from aiodist import _multicast

        if _multicast.is_multicast_address(host):
            found = await _multicast.discover(host, port, world_size, timeout=timeout)
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
        st = await _tcp_store(host, port, world_size, rank, timeout)
        return Rendezvous(st, rank, world_size, True, host)

    if url.scheme == "file":
        path = url.path
        if not path:
            raise DistValueError(f"init_method {init_method!r} has no path")
        _need_world_size(world_size, init_method or "")
        fst = FileStore(path, world_size)
        fst.set_timeout(timeout)
        return Rendezvous(fst, rank, world_size, True, None)

    raise DistValueError(
        f"init_method {init_method!r}: unknown scheme {url.scheme!r} (use env://, tcp:// or file://)"
    )


def _need_world_size(world_size: int, where: str) -> None:
    if world_size <= 0:
        raise DistValueError(
            f"init_method {where} needs world_size (argument, WORLD_SIZE or a launcher variable)"
        )
