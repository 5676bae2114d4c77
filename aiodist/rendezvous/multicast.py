"""Rendezvous over UDP multicast: the legacy ``tcp://<multicast group>:port`` init method.

Every participant opens a TCP listening socket, draws a random 128-bit member id and announces
``(group_name, world_size, member id, host, listening port)`` to the multicast group a few times a
second, while collecting the announcements of the others. Once it has heard ``world_size`` distinct
members (and nothing more for a short settle time), ranks are the positions of the member ids in
sorted order; rank 0's listening socket becomes the store's server socket. A participant that has
finished keeps announcing, now with the sorted roster attached, until every member of that roster
has announced the same roster (or a short linger ends), so slower members finish too. The roster
also lets a process tell a finished rendezvous it is not part of (for example the previous job on
the same address) from its own. The datagram codec and the rendezvous state are pure; ``discover``
does the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import itertools
import math
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from aiodist.errors import DistError, DistNetworkError, DistTimeoutError, DistTypeError, DistValueError
from aiodist.settings import Settings

__all__ = [
    "MAX_DATAGRAM",
    "MAX_WORLD_SIZE",
    "Announcement",
    "DatagramError",
    "Discovery",
    "decode_announcement",
    "discover",
    "encode_announcement",
    "is_multicast_address",
]

MAGIC = "aiodist-mc"
VERSION = 1
MEMBER_ID_BYTES = 16
MAX_GROUP_NAME_BYTES = 255
# A finished member's announcement carries the whole roster (16 bytes per rank), so the world
# size is capped to keep datagrams within one UDP packet and the announcement traffic modest.
MAX_WORLD_SIZE = 1024
MAX_DATAGRAM = 32 * 1024
MULTICAST_IF_ENV = "AIODIST_MULTICAST_IF"

# Announce every 50-100 ms; the jitter keeps many processes started together from sending in lockstep.
ANNOUNCE_MIN = 0.05
ANNOUNCE_MAX = 0.10
# After hearing world_size members, wait this long for an unexpected extra one before fixing ranks.
SETTLE = 0.15
# A member not heard from for this long (before ranks are fixed) is considered gone.
MEMBER_EXPIRY = 2.0
# How long a finished member keeps announcing for slower ones at most, and at least.
LINGER_MAX = 1.5
LINGER_MIN = 0.2
FINAL_REPEATS = 3
FINAL_GAP = 0.02
# Valid announcements waiting for the rendezvous loop; beyond this they are dropped (senders repeat).
INBOX_SIZE = 4096


class DatagramError(ValueError):
    """A datagram on the group port is not a valid announcement for us; it is ignored."""


@dataclass(frozen=True, slots=True)
class Announcement:
    """What one participant tells the group.

    ``roster`` is empty while the sender is still collecting; once it has fixed the ranks it is
    the sorted tuple of all ``world_size`` member ids, the sender's among them.
    """

    group_name: str
    world_size: int
    member_id: bytes
    host: str
    port: int
    roster: tuple[bytes, ...] = ()

    @property
    def complete(self) -> bool:
        """Whether the sender has fixed its ranks."""
        return bool(self.roster)


@dataclass(frozen=True, slots=True)
class Discovery:
    """The outcome of a multicast rendezvous for this process.

    ``listen_sock`` is rank 0's listening TCP socket (still open, owned by the caller from now on,
    meant for the store server); every other rank gets None and connects to
    ``master_addr:master_port``.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    listen_sock: socket.socket | None


def is_multicast_address(host: str) -> bool:
    """Whether ``host`` is an IPv4 multicast address literal (224.0.0.0/4).

    Args:
        host: a host string, e.g. the host part of a ``tcp://`` init method.

    Returns:
        True for an IPv4 multicast literal, False for anything else (names included).
    """
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    return isinstance(addr, ipaddress.IPv4Address) and addr.is_multicast


# --------------------------------------------------------------------------- datagram codec


def _mac(secret: bytes | None, body: bytes) -> bytes:
    if not secret:
        return b""
    # Magic and version are bound into the MAC so that no other message kind can be replayed as ours.
    return hmac.new(secret, MAGIC.encode() + VERSION.to_bytes(2, "big") + body, hashlib.sha256).digest()


def encode_announcement(ann: Announcement, secret: bytes | None) -> bytes:
    """Serialize one announcement as a datagram.

    Layout: msgpack ``[MAGIC, VERSION, body, mac]`` where ``body`` is the msgpack of
    ``[group_name, world_size, member_id, host, port, roster]`` and ``mac`` is
    HMAC-SHA256(secret, magic | version | body), or empty without a secret.

    Args:
        ann: the announcement.
        secret: the shared ``AIODIST_SECRET``, or None.

    Returns:
        The datagram bytes (at most ``MAX_DATAGRAM`` for valid inputs).
    """
    body = msgpack.packb(
        [ann.group_name, ann.world_size, ann.member_id, ann.host, ann.port, list(ann.roster)],
        use_bin_type=True,
    )
    packed: bytes = msgpack.packb([MAGIC, VERSION, body, _mac(secret, body)], use_bin_type=True)
    return packed


def _valid_host(host: Any) -> bool:
    if not isinstance(host, str) or len(host) > 15:
        return False
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return not (addr.is_multicast or addr.is_unspecified)


def decode_announcement(data: bytes, secret: bytes | None) -> Announcement:
    """Parse and authenticate one datagram.

    The MAC is checked before the body is decoded, so an unauthenticated sender cannot make us
    parse anything beyond the small envelope. Without a secret, a datagram that carries a MAC is
    rejected too: its sender belongs to a job configured differently from ours.

    Args:
        data: the datagram as received.
        secret: the shared ``AIODIST_SECRET``, or None.

    Returns:
        The announcement.

    Raises:
        DatagramError: oversized, not ours, another protocol version, failed authentication, or
            malformed in any way.
    """
    if len(data) > MAX_DATAGRAM:
        raise DatagramError(f"datagram of {len(data)} bytes exceeds {MAX_DATAGRAM}")
    try:
        envelope = msgpack.unpackb(
            data,
            raw=False,
            max_str_len=64,
            max_bin_len=MAX_DATAGRAM,
            max_array_len=8,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DatagramError("not msgpack") from exc
    if not (isinstance(envelope, list) and len(envelope) == 4 and envelope[0] == MAGIC):
        raise DatagramError("not an aiodist announcement")
    _, version, body, mac = envelope
    if version != VERSION:
        raise DatagramError(f"announcement of protocol version {version!r}, we speak {VERSION}")
    if not (isinstance(body, bytes) and isinstance(mac, bytes)):
        raise DatagramError("malformed announcement envelope")
    if not hmac.compare_digest(_mac(secret, body), mac):
        raise DatagramError("announcement failed authentication (wrong or missing AIODIST_SECRET)")
    try:
        fields = msgpack.unpackb(
            body,
            raw=False,
            max_str_len=MAX_GROUP_NAME_BYTES,
            max_bin_len=MEMBER_ID_BYTES,
            max_array_len=max(MAX_WORLD_SIZE, 6),
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:
        raise DatagramError("malformed announcement body") from exc
    if not (isinstance(fields, list) and len(fields) == 6):
        raise DatagramError("malformed announcement body")
    group_name, world_size, member_id, host, port, roster = fields
    if not (
        isinstance(group_name, str)
        and type(world_size) is int
        and 1 <= world_size <= MAX_WORLD_SIZE
        and isinstance(member_id, bytes)
        and len(member_id) == MEMBER_ID_BYTES
        and _valid_host(host)
        and type(port) is int
        and 1 <= port <= 65535
        and isinstance(roster, list)
    ):
        raise DatagramError("malformed announcement fields")
    # A roster is the complete, sorted set of member ids, the sender's included.
    if roster and not (
        len(roster) == world_size
        and all(isinstance(m, bytes) and len(m) == MEMBER_ID_BYTES for m in roster)
        and all(a < b for a, b in itertools.pairwise(roster))
        and member_id in roster
    ):
        raise DatagramError("malformed announcement roster")
    return Announcement(group_name, world_size, member_id, host, port, tuple(roster))


# --------------------------------------------------------------------------- rendezvous state


class _Rendezvous:
    """One participant's view of the rendezvous, fed announcements and the clock; no I/O.

    Collecting: every member heard from (including ourselves) is kept. Once ``world_size`` are
    known and ``settle`` seconds pass without an extra one, the roster is fixed ("finished").
    Finished: announcements of members outside our roster are ignored (a later job may reuse the
    address), and ``done`` turns true when every roster member has announced the same roster.
    """

    def __init__(self, me: Announcement, *, where: str, settle: float = SETTLE) -> None:
        self._me = me
        self._where = where
        self._settle = settle
        self._members: dict[bytes, Announcement] = {me.member_id: me}
        self._heard: dict[bytes, float] = {}
        self._full_since: float | None = None
        # A roster heard from a finished peer that includes us: ours must come out the same.
        self._claimed: tuple[bytes, ...] | None = None
        self._finished_peers: set[bytes] = set()
        self.roster: tuple[bytes, ...] | None = None
        # Finished peers whose roster leaves us out; reported on timeout as a hint.
        self.excluded_by: set[bytes] = set()

    @property
    def found(self) -> int:
        """How many distinct members (ourselves included) are currently known."""
        return len(self._members)

    @property
    def done(self) -> bool:
        """Ranks are fixed and every member has been heard confirming the same roster."""
        return self.roster is not None and self._finished_peers.issuperset(self.roster)

    def announcement(self) -> Announcement:
        """What we announce now: ourselves, with the roster once it is fixed."""
        return self._me if self.roster is None else replace(self._me, roster=self.roster)

    def result(self) -> tuple[int, Announcement]:
        """Our rank and rank 0's announcement; only once the roster is fixed."""
        if self.roster is None:
            raise RuntimeError("rendezvous not finished")  # internal misuse, not user input
        return self.roster.index(self._me.member_id), self._members[self.roster[0]]

    def next_wakeup(self) -> float | None:
        """The clock time at which ``tick`` has something to do, if any."""
        if self.roster is None and self._full_since is not None:
            return self._full_since + self._settle
        return None

    def _disagree(self, other: tuple[bytes, ...]) -> DistError:
        return DistError(
            f"multicast rendezvous on {self._where} (group {self._me.group_name!r}): members disagree on "
            f"who belongs to the job ({len(other)} vs {self.found} members); is another job using the same "
            f"group_name, or were more than world_size={self._me.world_size} processes started?"
        )

    def feed(self, ann: Announcement, now: float) -> None:
        """Take one authenticated announcement into account.

        Raises:
            DistError: a member of our group expects another world size, more than world_size
                members showed up, or finished members disagree on the roster.
        """
        me = self._me
        if ann.group_name != me.group_name or ann.member_id == me.member_id:
            return  # another job's traffic, or our own datagram looped back
        if ann.complete and me.member_id not in ann.roster:
            # A finished rendezvous we are not part of: not our job, even if it was heard before.
            self.excluded_by.add(ann.member_id)
            self._forget(ann.member_id)
            return
        if self.roster is not None:
            if ann.member_id in self.roster and ann.complete:
                if ann.roster != self.roster:
                    raise self._disagree(ann.roster)
                self._finished_peers.add(ann.member_id)
            return
        if ann.world_size != me.world_size:
            raise DistError(
                f"multicast rendezvous on {self._where} (group {me.group_name!r}): the member at "
                f"{ann.host}:{ann.port} expects world_size={ann.world_size}, this process {me.world_size}"
            )
        if ann.complete:
            if self._claimed is not None and self._claimed != ann.roster:
                raise self._disagree(ann.roster)
            self._claimed = ann.roster
        self._members[ann.member_id] = ann
        self._heard[ann.member_id] = now
        if len(self._members) > me.world_size:
            raise DistValueError(
                f"multicast rendezvous on {self._where} (group {me.group_name!r}) found "
                f"{len(self._members)} members but world_size is {me.world_size}; give concurrent jobs "
                f"distinct group_names"
            )
        if len(self._members) == me.world_size and self._full_since is None:
            self._full_since = now

    def _forget(self, member_id: bytes) -> None:
        if self.roster is None and self._members.pop(member_id, None) is not None:
            self._heard.pop(member_id, None)
            self._full_since = None

    def tick(self, now: float) -> None:
        """Advance the clock: expire silent members, fix the roster when it has settled.

        Raises:
            DistError: our roster differs from one a finished peer announced.
        """
        if self.roster is not None:
            return
        for member_id, heard in list(self._heard.items()):
            if now - heard > MEMBER_EXPIRY:
                self._forget(member_id)
        if len(self._members) != self._me.world_size:
            return
        if self._full_since is None:
            self._full_since = now  # world_size 1: nobody else will ever be fed
        # A finished peer already settled exactly this set: no need to wait out our own settle time.
        agreed = self._claimed is not None and set(self._claimed) == self._members.keys()
        if agreed or (self._full_since is not None and now - self._full_since >= self._settle):
            roster = tuple(sorted(self._members))
            if self._claimed is not None and self._claimed != roster:
                raise self._disagree(self._claimed)
            self.roster = roster
            self._finished_peers.add(self._me.member_id)


# --------------------------------------------------------------------------- I/O


def _choose_interface(group_addr: str, port: int, interface: str | None, from_env: str) -> str:
    """The IPv4 address of the interface to use: argument, then ``AIODIST_MULTICAST_IF``
    (``from_env``), then the route."""
    source = "interface"
    if interface is None and from_env:
        interface, source = from_env, MULTICAST_IF_ENV
    if interface is None:
        # Ask the kernel which local address it would send to the group from; with no route
        # for multicast at all, the group can only be used on this host, over loopback.
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((group_addr, port))
            interface = probe.getsockname()[0]
        except OSError:
            interface = "127.0.0.1"
        finally:
            probe.close()
        if interface == "0.0.0.0":
            interface = "127.0.0.1"
    if not _valid_host(interface):
        raise DistValueError(f"{source}={interface!r} is not the IPv4 address of a local interface")
    return interface


def _open_listener(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _open_group_socket(group_addr: str, port: int, interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    try:
        # Several processes on one host must all bind the group port, and all receive every datagram.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            # Binding the group address (Linux, BSD) filters out datagrams for other groups on this port.
            sock.bind((group_addr, port))
        except OSError:
            sock.bind(("", port))
        group, iface = socket.inet_aton(group_addr), socket.inet_aton(interface)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group + iface)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, iface)
        # Members on this host must hear each other; TTL 1 keeps announcements on the local link.
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Receiver(asyncio.DatagramProtocol):
    """Decodes datagrams as they arrive and queues the valid ones of our group; drops the rest."""

    def __init__(self, group_name: str, secret: bytes | None, inbox: asyncio.Queue[Announcement]) -> None:
        self._group_name = group_name
        self._secret = secret
        self._inbox = inbox
        self.ignored = 0
        self.last_error: OSError | None = None

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        try:
            ann = decode_announcement(data, self._secret)
        except DatagramError:
            self.ignored += 1
            return
        if ann.group_name == self._group_name and not self._inbox.full():
            self._inbox.put_nowait(ann)

    def error_received(self, exc: Exception) -> None:
        # A failed send (e.g. no route) is kept for the timeout message; announcing goes on.
        if isinstance(exc, OSError):
            self.last_error = exc


def _validate(group_addr: str, port: int, world_size: int, group_name: str, timeout: float) -> None:
    if not isinstance(group_addr, str) or not is_multicast_address(group_addr):
        raise DistValueError(f"{group_addr!r} is not an IPv4 multicast address (224.0.0.0/4)")
    for name, value in (("port", port), ("world_size", world_size)):
        if type(value) is not int:
            raise DistTypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 1 <= port <= 65535:
        raise DistValueError(f"port must be in 1..65535, got {port}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise DistValueError(
            f"multicast rendezvous needs 1 <= world_size <= {MAX_WORLD_SIZE}, got {world_size}; "
            f"use tcp://host:port or env:// for larger jobs"
        )
    if not isinstance(group_name, str):
        raise DistTypeError(f"group_name must be a str, not {type(group_name).__name__}")
    if len(group_name.encode()) > MAX_GROUP_NAME_BYTES:
        raise DistValueError(f"group_name is longer than {MAX_GROUP_NAME_BYTES} bytes")
    if not (isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)):
        raise DistValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


async def discover(
    group_addr: str,
    port: int,
    world_size: int,
    *,
    group_name: str = "default",
    timeout: float,
    interface: str | None = None,
    secret: bytes | None = None,
    settings: Settings | None = None,
) -> Discovery:
    """Find the other ``world_size - 1`` processes over UDP multicast and assign ranks.

    Every process of the job calls this with the same group address, port, world size and
    group name. Ranks follow the sorted random member ids, so they are assigned automatically
    and are not tied to start order. Several jobs may share one group address and port if their
    ``group_name`` differs.

    Args:
        group_addr: an IPv4 multicast group, e.g. ``"239.255.10.10"``.
        port: the UDP port of the group.
        world_size: the number of processes in the job.
        group_name: keeps jobs sharing a group address apart.
        timeout: seconds to wait for all members.
        interface: IPv4 address of the local interface to use; defaults to ``AIODIST_MULTICAST_IF``,
            else the interface the kernel routes the group through, else loopback (127.0.0.1).
        secret: key authenticating announcements; None reads ``AIODIST_SECRET``, ``b""`` disables it.
            Announcements that fail authentication are ignored.
        settings: the job's settings (``AIODIST_MULTICAST_IF``, ``AIODIST_SECRET``); None reads them.

    Returns:
        This process's rank, rank 0's address and, on rank 0 only, its listening socket, which
        the caller now owns (to be handed to the store server).

    Raises:
        DistValueError, DistTypeError: invalid arguments, or more than ``world_size`` members
            announced themselves under this group name.
        DistError: a member expects another world size, or members disagree on the roster.
        DistNetworkError: the group could not be joined on this interface.
        DistTimeoutError: not all members were found within ``timeout``; the message says how
            many were.

    On any error or cancellation every socket this call opened is closed and announcing stops;
    no background task outlives the call.
    """
    _validate(group_addr, port, world_size, group_name, timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    where = f"{group_addr}:{port}"
    settings = Settings.read() if settings is None else settings
    host = _choose_interface(group_addr, port, interface, settings.multicast_if)
    key = settings.secret if secret is None else (secret or None)

    try:
        listener = _open_listener(host)
    except OSError as exc:
        raise DistNetworkError(f"cannot listen on interface {host} for multicast rendezvous: {exc}") from exc
    try:
        try:
            group_sock = _open_group_socket(group_addr, port, host)
        except OSError as exc:
            raise DistNetworkError(f"cannot join multicast group {where} on interface {host}: {exc}") from exc
        inbox: asyncio.Queue[Announcement] = asyncio.Queue(INBOX_SIZE)
        receiver = _Receiver(group_name, key, inbox)
        try:
            transport, _ = await loop.create_datagram_endpoint(lambda: receiver, sock=group_sock)
        except BaseException:
            group_sock.close()
            raise
        try:
            me = Announcement(
                group_name, world_size, os.urandom(MEMBER_ID_BYTES), host, listener.getsockname()[1]
            )
            state = _Rendezvous(me, where=where)

            def send(ann: Announcement) -> None:
                transport.sendto(encode_announcement(ann, key), (group_addr, port))

            await _run(state, send, inbox, deadline, receiver, timeout=timeout, where=where)
        finally:
            transport.close()
        rank, master = state.result()
    except BaseException:
        listener.close()
        raise
    if rank != 0:
        listener.close()
        return Discovery(rank, world_size, master.host, master.port, None)
    return Discovery(rank, world_size, master.host, master.port, listener)


async def _run(
    state: _Rendezvous,
    send: Callable[[Announcement], None],
    inbox: asyncio.Queue[Announcement],
    deadline: float,
    receiver: _Receiver,
    *,
    timeout: float,
    where: str,
) -> None:
    """Announce and collect until the roster is fixed and confirmed (or the linger ends)."""
    loop = asyncio.get_running_loop()
    next_send = loop.time()
    linger_end: float | None = None
    while True:
        now = loop.time()
        state.tick(now)
        if state.roster is not None:
            if linger_end is None:
                # Finished: tell the others at once, then keep announcing for the slower ones.
                linger_end = max(now + LINGER_MIN, min(now + LINGER_MAX, deadline))
                next_send = now
            if state.done:
                # The last to finish has nobody left to wait for; repeat its roster a few times
                # so that the others, waiting for exactly this, hear it despite a lost datagram.
                for i in range(FINAL_REPEATS):
                    if i:
                        await asyncio.sleep(FINAL_GAP)
                    send(state.announcement())
                return
            if now >= linger_end:
                return
        elif now >= deadline:
            raise _timeout_error(state, receiver, timeout=timeout, where=where)
        if now >= next_send:
            send(state.announcement())
            next_send = now + random.uniform(ANNOUNCE_MIN, ANNOUNCE_MAX)
        wake = min(next_send, linger_end if linger_end is not None else deadline)
        settle = state.next_wakeup()
        if settle is not None:
            wake = min(wake, settle)
        try:
            async with asyncio.timeout_at(wake):
                ann = await inbox.get()
        except TimeoutError:
            continue
        state.feed(ann, loop.time())
        while not inbox.empty():
            state.feed(inbox.get_nowait(), loop.time())


def _timeout_error(
    state: _Rendezvous, receiver: _Receiver, *, timeout: float, where: str
) -> DistTimeoutError:
    me = state.announcement()
    msg = (
        f"multicast rendezvous on {where} found {state.found} of {me.world_size} members "
        f"(group {me.group_name!r}, interface {me.host}) within {timeout:g} s"
    )
    if state.excluded_by:
        msg += (
            f"; {len(state.excluded_by)} other process(es) finished a rendezvous of this group without "
            f"this one (an earlier job, or more than world_size processes started?)"
        )
    if receiver.ignored:
        msg += f"; ignored {receiver.ignored} datagram(s) that failed authentication or were malformed"
    if receiver.last_error is not None:
        msg += f"; last send error: {receiver.last_error}"
    return DistTimeoutError(msg)
