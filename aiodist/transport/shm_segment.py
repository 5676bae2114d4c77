"""The memory under the shared-memory path: segments, the SPSC ring inside one, and single-copy
reads of another process's memory (Linux cross-memory attach, ``process_vm_readv``).

A segment is a file in ``SEGMENT_DIR`` (``/dev/shm``) created ``O_EXCL`` with mode 0600 by the
rank that writes into it, mapped by both ends of one direction, and unlinked by its creator as
soon as the reader has proved it maps the same memory: from then on nothing is left in the
directory, whatever happens to the processes. Its layout (offsets in bytes)::

    0     magic                  8     nonce (the creator's)     32   echo (the reader's)
    128   head   (creator)       256   tail  (reader)            384  claimed (reader)
    512   creator polls          640   creator blocked on room   768  claims seen (creator)
    1024  withdrawn descriptors (creator, ``DESC_SLOTS`` words)
    1536  verdicts on them       (creator, ``DESC_SLOTS`` words)
    4096  ring data (``capacity`` bytes, a power of two)

Each counter is an aligned 8-byte word with one writer, on a cache line of its own. The
writer publishes a record by storing ``head`` after the record's bytes; the reader reads
``head`` before the bytes, and frees them by storing ``tail`` after it is done with them.
x86-64 keeps stores in order with stores and loads with loads (TSO), which is all this needs;
on other machines the doorbells (system calls, full barriers) order them, and the path that
skips doorbells is off (see ``SKIP_BELLS``).

A single-copy read (a descriptor) is the reader's once it has *claimed* it, and the writer may
take it back until then (its send failed, and its caller may reuse the buffer): the reader
stores its claim, then (after a full barrier, ``fence``) looks at whether the writer withdrew the
descriptor; the writer stores the withdrawal, then (after a barrier) looks at the claim, and
writes its verdict. Each side stores before it loads, so they cannot both miss the other
(Dekker's handshake): a reader that saw no withdrawal has the data, and the writer saw its
claim; a reader that saw one waits for the writer's verdict. Descriptors are numbered per ring;
the slots of their withdrawals and verdicts hold the number, so a slot's old value is never
taken for a newer descriptor's (at most ``DESC_SLOTS`` are outstanding).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import mmap
import os
import platform
import secrets
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from aiodist.native import compiled
from aiodist.wire.shm import ALIGN, RECORD, WRAP, record_size

__all__ = [
    "CAPACITY",
    "Doorbell",
    "PREFIX",
    "SEGMENT_DIR",
    "SKIP_BELLS",
    "Ring",
    "Rings",
    "Segment",
    "TSO",
    "address_of",
    "fence",
    "ring_type",
    "unlink_name",
    "cma_read",
    "sweep",
]

SEGMENT_DIR = "/dev/shm"
PREFIX = "aiodist-"
CAPACITY = 4 * 1024 * 1024
_DATA_OFFSET = 4096
_MAGIC = 0x6D68732D64696F61  # "aiod-shm"
# 8-byte word indices of the header fields
W_MAGIC = 0
W_HEAD = 16
W_TAIL = 32
W_ACKED = 48
W_POLLING = 64
W_BLOCKED = 80
W_SEEN = 96
W_SLEEPING = 112  # caller threads of the writer's process asleep on its peer's records
W_WAKE = 113  # their futex word (its low half), which a wake counts up
W_WITHDRAWN = 128  # DESC_SLOTS words
W_VERDICT = 192  # DESC_SLOTS words
DESC_SLOTS = 32
NONCE = slice(8, 24)
ECHO = slice(32, 48)

# x86 keeps stores in order with stores and loads with loads, and a locked instruction is a
# full barrier: what skipping doorbells and the descriptors' handshake (``fence``) need. Elsewhere
# doorbells are always rung and large messages go through the ring in pieces.
TSO = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
SKIP_BELLS = TSO

_barrier = threading.Lock()


def fence() -> None:
    """A full memory barrier (on x86: taking a lock is a locked read-modify-write)."""
    _barrier.acquire()
    _barrier.release()


def _check_name(name: str) -> None:
    if not name.startswith(PREFIX) or "/" in name or len(name) > 255:
        raise ValueError(f"not a segment name of aiodist: {name!r}")


class Segment:
    """One mapped segment. ``create`` makes a new one (this process writes its ring);
    ``attach`` maps a peer's (this process reads its ring)."""

    def __init__(self, name: str, mm: mmap.mmap, capacity: int, *, owner: bool, directory: str) -> None:
        self.name = name
        self.directory = directory
        self.capacity = capacity
        self.owner = owner
        self.linked = owner  # the name still exists in SEGMENT_DIR (only its creator unlinks it)
        self._mm: mmap.mmap | None = mm
        self.view = memoryview(mm)
        self.words = self.view[:_DATA_OFFSET].cast("Q")
        self.data = self.view[_DATA_OFFSET : _DATA_OFFSET + capacity]

    @classmethod
    def create(cls, job: str, capacity: int = CAPACITY, directory: str | None = None) -> Segment:
        """A new segment named ``aiodist-<job>-<128 random bits>``, mode 0600, zeroed.

        Raises:
            OSError: the directory is missing, full or not writable.
        """
        name = f"{PREFIX}{job}-{secrets.token_hex(16)}"
        path = os.path.join(directory or SEGMENT_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _DATA_OFFSET + capacity)
            mm = mmap.mmap(fd, _DATA_OFFSET + capacity)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        seg = cls(name, mm, capacity, owner=True, directory=directory or SEGMENT_DIR)
        seg.words[W_MAGIC] = _MAGIC
        seg.view[NONCE] = secrets.token_bytes(16)
        _note_created(path)
        return seg

    @classmethod
    def attach(cls, name: str, directory: str | None = None) -> Segment:
        """Map a peer's segment, after checking it is one: ours (uid), 0600, the right size.

        Raises:
            OSError: it cannot be opened or mapped (another host, another user, another /dev/shm).
            ValueError: it is not an aiodist segment.
        """
        _check_name(name)
        path = os.path.join(directory or SEGMENT_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600 or not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path} is not a private segment of this user")
            capacity = st.st_size - _DATA_OFFSET
            if capacity < 4096 or capacity & (capacity - 1):
                raise ValueError(f"{path} has an unexpected size ({st.st_size} bytes)")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        seg = cls(name, mm, capacity, owner=False, directory=directory or SEGMENT_DIR)
        if seg.words[W_MAGIC] != _MAGIC:
            seg.close()
            raise ValueError(f"{path} is not an aiodist segment")
        return seg

    @property
    def nonce(self) -> bytes:
        return bytes(self.view[NONCE])

    def address(self) -> int:
        """Where this process maps the segment (for a peer's single-copy probe)."""
        anchor = ctypes.c_char.from_buffer(self._mm)  # type: ignore[arg-type]
        addr = ctypes.addressof(anchor)
        del anchor
        return addr

    def unlink(self) -> None:
        """Remove the name (the mapping lives on); idempotent."""
        if self.owner and self.linked:
            self.linked = False
            unlink_name(self.name, self.directory)

    def close(self) -> None:
        """Unlink (if ours) and unmap. Views handed out must be gone: else the unmapping waits for GC."""
        self.unlink()
        mm, self._mm = self._mm, None
        if mm is None:
            return
        # (a view still exported somewhere: the mapping goes when it does)
        with contextlib.suppress(BufferError):
            for v in (self.data, self.words, self.view):
                v.release()
            mm.close()


class Doorbell:
    """What wakes one rank: a Unix datagram socket it reads, named in ``SEGMENT_DIR``, into which
    a peer sends one byte.

    Why: a peer that is not polling must be woken, and a frame on its TCP connection costs both
    sides tens of microseconds of Python (the writer's frame, the reader's parsing), where one
    datagram is a system call each. Why a datagram socket: it has a name (an eventfd can only be
    shared by passing the descriptor), a send to a reader that has gone fails with an error,
    never with SIGPIPE (a named pipe's write would kill a program that restored SIGPIPE's default
    action), and a reader is never woken by a writer that left (a pipe reads as ready forever
    then). Like a segment: mode 0600, a random name, made by its reader and unlinked as soon as
    the writer has connected (``unlink_name``); a connected socket needs no name.
    """

    @staticmethod
    def create(job: str, directory: str | None = None) -> tuple[str, socket.socket]:
        """A new doorbell: its name, and the reading end (non-blocking).

        Raises:
            OSError: the directory is missing, full or not writable.
        """
        name = f"{PREFIX}{job}-bell-{secrets.token_hex(16)}"
        path = os.path.join(directory or SEGMENT_DIR, name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            _note_created(path)
            os.chmod(path, 0o600)  # (before its name is given to anyone)
        except BaseException:
            sock.close()
            unlink_name(name, directory)
            raise
        return name, sock

    @staticmethod
    def open(name: str, directory: str | None = None) -> socket.socket:
        """The sending end (non-blocking) of a peer's doorbell, after checking it is one: a socket
        of this user, mode 0600.

        Raises:
            OSError: it cannot be reached (gone, another host's directory).
            ValueError: it is not an aiodist doorbell.
        """
        _check_name(name)
        path = os.path.join(directory or SEGMENT_DIR, name)
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
            raise ValueError(f"{path} is not a private doorbell of this user")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    def ring(sock: socket.socket) -> bool:
        """Send a wake-up; False when the reader has gone (the caller rings otherwise then)."""
        try:
            sock.send(b"\x01")
        except BlockingIOError:  # (its queue is full: wake-ups are pending anyway)
            pass
        except OSError:
            return False
        return True

    @staticmethod
    def take(sock: socket.socket) -> None:
        """Take one wake-up. (Each look at the rings serves every wake-up sent before it; those
        still queued make the loop call the reader again, a look that costs nothing much. Reading
        until none is left would cost a raised ``BlockingIOError`` on every wake-up.)"""
        with contextlib.suppress(OSError):
            sock.recv(64)


def unlink_name(name: str, directory: str | None = None) -> None:
    """Remove a name this process created (a doorbell's); nothing if it is gone already."""
    path = os.path.join(directory or SEGMENT_DIR, name)
    _created.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _note_created(path: str) -> None:
    """Unlink ``path`` at exit unless it is unlinked before."""
    if not _created and not _exit_hook:
        _exit_hook.append(True)
        atexit.register(unlink_ours)
    _created.add(path)


# Paths this process created and has not unlinked yet: unlinked at exit (see ``unlink_ours``).
_created: set[str] = set()
_exit_hook: list[bool] = []


def unlink_ours() -> None:
    """Unlink every segment this process created and still has a name for (at exit)."""
    for path in list(_created):
        _created.discard(path)
        with contextlib.suppress(OSError):
            os.unlink(path)


def sweep(job: str, directory: str | None = None) -> list[str]:
    """Remove what is left of job ``job``'s segments (after its processes exited); returns the names."""
    if not job or "/" in job:
        return []
    d = directory or SEGMENT_DIR
    removed = []
    try:
        names = os.listdir(d)
    except OSError:
        return []
    for name in names:
        if name.startswith(f"{PREFIX}{job}-"):
            try:
                os.unlink(os.path.join(d, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class Rings(Protocol):
    """What the transport uses of a ring: ``Ring``, and its compiled twin (``_shm_ring.pyx``)."""

    words: memoryview
    head: int

    def try_write(self, header: bytes, payload: memoryview) -> bool: ...
    def consumed(self) -> int: ...
    def peek(self) -> tuple[memoryview, memoryview, int] | None: ...
    def advance(self, rlen: int) -> None: ...
    def pending(self) -> bool: ...
    def wake_sleepers(self) -> bool: ...


def ring_type() -> Callable[[Segment], Rings]:
    """What makes the ring of a segment: the compiled twin of ``Ring`` where this process runs
    it (``aiodist.native``), else ``Ring``. Asked when a transport is made, so that a compiled
    part that ``AIODIST_NATIVE=1`` requires and that is missing fails the job's start.

    Raises:
        DistError: ``AIODIST_NATIVE=1`` and the compiled ring is not built.
    """
    native = compiled("aiodist.transport._shm_ring")
    make: Callable[[Segment], Rings] = Ring if native is None else native.Ring
    return make


class Ring:
    """A single-producer single-consumer ring of records inside a segment.

    The producer keeps ``head`` locally and publishes it; the consumer keeps ``tail``.
    Records never straddle the end: one that would is preceded by a WRAP record.
    """

    __slots__ = ("_tail_pub", "cap", "data", "head", "mask", "seg", "tail", "words")

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.data = seg.data
        self.words = seg.words
        self.cap = seg.capacity
        self.mask = seg.capacity - 1
        self.head = int(self.words[W_HEAD])
        self.tail = int(self.words[W_TAIL])
        self._tail_pub = self.tail

    @property
    def max_record(self) -> int:
        """The largest record that always fits in an empty ring."""
        return self.cap // 2

    # -- producer ------------------------------------------------------------------------
    def try_write(self, header: bytes, payload: memoryview) -> bool:
        """Append one record; False when there is no room now (nothing written)."""
        plen = payload.nbytes
        hlen = len(header)
        need = record_size(hlen, plen)
        head = self.head
        pos = head & self.mask
        free = self.cap - (head - int(self.words[W_TAIL]))
        pad = self.cap - pos if pos + need > self.cap else 0
        if pad + need > free:
            return False
        data = self.data
        if pad:
            RECORD.pack_into(data, pos, pad, WRAP, 0)
            head += pad
            pos = 0
        RECORD.pack_into(data, pos, need, hlen, plen)
        start = pos + RECORD.size
        data[start : start + hlen] = header
        if plen:
            data[start + hlen : start + hlen + plen] = payload
        self.head = head + need
        self.words[W_HEAD] = self.head  # publish (after the bytes: stores stay in order)
        return True

    def consumed(self) -> int:
        """Bytes the consumer has freed so far."""
        return int(self.words[W_TAIL])

    # -- consumer ------------------------------------------------------------------------
    def peek(self) -> tuple[memoryview, memoryview, int] | None:
        """The next record (header bytes, payload, record length), or None when empty.

        Raises:
            ValueError: the ring holds nonsense (the producer broke the protocol).
        """
        while True:
            tail = self.tail
            head = int(self.words[W_HEAD])
            if tail == head:
                return None
            if head - tail > self.cap or tail & (ALIGN - 1):
                raise ValueError(f"ring counters out of range (head {head}, tail {tail})")
            pos = tail & self.mask
            rlen, hlen, plen = RECORD.unpack_from(self.data, pos)
            if rlen < RECORD.size or rlen & (ALIGN - 1) or pos + rlen > self.cap or rlen > head - tail:
                raise ValueError(f"bad record length {rlen} at {pos}")
            if hlen == WRAP:
                self.tail = tail + rlen
                continue
            if RECORD.size + hlen + plen > rlen:
                raise ValueError(f"record at {pos} overflows its length")
            start = pos + RECORD.size
            return self.data[start : start + hlen], self.data[start + hlen : start + hlen + plen], rlen

    def advance(self, rlen: int) -> None:
        """Done with the record ``peek`` returned: free it (and any WRAP before it)."""
        self.tail += rlen
        self.words[W_TAIL] = self.tail

    def pending(self) -> bool:
        return int(self.words[W_HEAD]) != self.tail

    # -- sleepers (the compiled twin's: Python has no futex) -----------------------------
    can_sleep = False

    def wake_sleepers(self) -> bool:
        """Caller threads asleep on this ring's header (the compiled ``sleep_pending``, in a
        peer of the other engine) are not woken from Python: they look again after a nap."""
        return False


# -- single-copy reads (cross-memory attach) ---------------------------------------------------


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_readv() -> object | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _load_readv()


def address_of(buf: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def cma_read(pid: int, remote: int, dst: memoryview) -> None:
    """Copy ``dst.nbytes`` bytes at address ``remote`` of process ``pid`` into ``dst``.

    Raises:
        OSError: ESRCH (the process is gone), EPERM (not allowed), EFAULT (a bad address),
            ENOSYS (no cross-memory attach here).
    """
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    n = dst.nbytes
    if n == 0:
        return
    local_base = address_of(dst)
    done = 0
    local, far = _IoVec(), _IoVec()
    while done < n:
        local.base, local.len = local_base + done, n - done
        far.base, far.len = remote + done, n - done
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)  # type: ignore[operator]
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(errno.EFAULT, "process_vm_readv read nothing")
        done += got


def chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive pieces of at most ``size`` bytes covering ``n`` bytes."""
    for start in range(0, n, size):
        yield start, min(n, start + size)
