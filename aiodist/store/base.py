"""The abstract ``Store``: the async key-value interface every rendezvous store implements.

Keys are ``str``; values are ``bytes`` (a ``str`` value is stored UTF-8 encoded). Waiting
calls (``get``, ``wait``, ``multi_get``) are bounded by the store timeout and raise
``DistTimeoutError`` naming the keys that never appeared.
"""

from __future__ import annotations

import abc
import datetime
import math
from collections.abc import Sequence
from types import TracebackType
from typing import Self

from aiodist.errors import DistStoreError, DistTimeoutError, DistTypeError, DistValueError

__all__ = [
    "DEFAULT_TIMEOUT",
    "PORT_ADVICE",
    "ForeignStoreError",
    "StoreShutDownError",
    "INT64_MAX",
    "INT64_MIN",
    "Store",
    "Timeout",
    "Value",
    "as_bytes",
    "as_seconds",
    "check_amount",
    "check_multi_set",
    "keys_timeout_error",
    "parse_counter",
    "validate_key",
    "validate_keys",
]

DEFAULT_TIMEOUT = 300.0
# Counters are 64-bit signed integers, as in torch (and as msgpack carries them).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

Value = bytes | bytearray | memoryview | str
Timeout = float | int | datetime.timedelta

PORT_ADVICE = (
    "choose a free port for the job (MASTER_PORT, or the port of init_method; under aiodist-run: "
    "--master-port PORT, or --standalone to pick a free one)"
)


class ForeignStoreError(DistStoreError):
    """``host:port`` answers, but not as a store this process may use.

    ``holder`` says who holds the address: ``"program"`` (something that does not speak the
    store protocol) or ``"job"`` (an aiodist store that refused our secret: another job, or
    a secret that differs from the store host's). ``why`` is what the probe saw.
    """

    def __init__(self, message: str, *, addr: str, holder: str, why: str) -> None:
        super().__init__(message)
        self.addr, self.holder, self.why = addr, holder, why


class StoreShutDownError(DistStoreError):
    """The store's host shut the store down in order (not a crash): a later store may take its place."""


def validate_key(key: object, what: str = "key") -> str:
    """Return ``key`` if it is a ``str``; otherwise raise ``DistTypeError``."""
    if not isinstance(key, str):
        raise DistTypeError(f"{what} must be a str, not {type(key).__name__}")
    return key


def validate_keys(keys: object, what: str = "keys") -> list[str]:
    """Return ``keys`` as a list of ``str``.

    A bare ``str`` is refused (it is a sequence of one-character keys, almost never what the
    caller meant).
    """
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise DistTypeError(f"{what} must be a list of str, not {type(keys).__name__}")
    return [validate_key(k, f"each of {what}") for k in keys]


def as_bytes(value: object, what: str = "value") -> bytes:
    """``value`` as ``bytes``: bytes-like objects are copied, ``str`` is UTF-8 encoded."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise DistTypeError(f"{what} must be bytes or str, not {type(value).__name__}")


def as_seconds(timeout: object, what: str = "timeout") -> float:
    """A timeout given as seconds (int/float) or ``timedelta``, as float seconds (``inf`` allowed)."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise DistTypeError(
            f"{what} must be seconds (float) or a datetime.timedelta, not {type(timeout).__name__}"
        )
    if math.isnan(seconds) or seconds < 0:
        raise DistValueError(f"{what} must be >= 0 seconds, got {seconds}")
    return seconds


class Store(abc.ABC):
    """A key-value store shared by the processes of a job, used for rendezvous.

    Lifetime: a store may be started explicitly (``await store.start()``) or lazily by its first
    call; ``await store.aclose()`` releases it gracefully and ``store.abort()`` at once. Both are
    idempotent. ``async with store:`` starts it and closes it on exit. Calls pending when the
    store is closed raise ``DistStoreError``.

    Cancellation: cancelling a task that waits in ``get``/``wait`` stops that wait only; the
    store stays usable.
    """

    # -- lifetime ------------------------------------------------------------------------
    async def start(self) -> None:  # noqa: B027 (a store with nothing to prepare keeps this no-op)
        """Make the store ready (connect, open files). Called implicitly by the first operation.

        Raises:
            DistStoreError: the store cannot be reached or opened.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the store gracefully. Pending calls raise ``DistStoreError``."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Release the store at once, without any I/O that could block."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- timeout -------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def timeout(self) -> float:
        """The default timeout of waiting calls, in seconds."""

    @abc.abstractmethod
    def set_timeout(self, timeout: Timeout) -> None:
        """Change the default timeout (seconds or ``timedelta``) of later calls.

        Raises:
            DistTypeError, DistValueError: ``timeout`` is not a non-negative duration.
        """

    # -- operations ----------------------------------------------------------------------
    @abc.abstractmethod
    async def set(self, key: str, value: Value) -> None:
        """Set ``key`` to ``value``, waking everyone waiting for it.

        Raises:
            DistTypeError: ``key`` is not a str or ``value`` not bytes/str.
            DistStoreError: the store failed.
        """

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set.

        Raises:
            DistTimeoutError: the key was not set in time (the message names it).
            DistStoreError: the store failed.
        """

    @abc.abstractmethod
    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer stored at ``key`` (0 when missing); return the new value.

        Raises:
            DistTypeError: ``amount`` is not an int.
            DistValueError: the current value is not a decimal integer.
        """

    @abc.abstractmethod
    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Atomically set ``key`` to ``desired`` if its value is ``expected``.

        A missing key counts as matching an empty ``expected``. Returns the value of the key
        after the call; when the key is missing and ``expected`` is not empty, returns
        ``expected`` (torch's semantics).
        """

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Wait until every key in ``keys`` is set.

        Args:
            keys: the keys to wait for.
            timeout: seconds or ``timedelta``; ``None`` means the store timeout.

        Raises:
            DistTimeoutError: some keys were still missing at the timeout (they are named).
        """

    @abc.abstractmethod
    async def check(self, keys: Sequence[str]) -> bool:
        """True when every key in ``keys`` is set right now (no waiting)."""

    @abc.abstractmethod
    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    @abc.abstractmethod
    async def num_keys(self) -> int:
        """How many keys the store holds."""

    @abc.abstractmethod
    async def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the value of ``key`` (set it when missing)."""

    @abc.abstractmethod
    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to the store timeout for all of them."""

    @abc.abstractmethod
    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set each of ``keys`` to the matching entry of ``values``.

        Raises:
            DistValueError: ``keys`` and ``values`` differ in length.
        """


def check_multi_set(keys: Sequence[str], values: Sequence[Value]) -> tuple[list[str], list[bytes]]:
    """Validate the arguments of ``multi_set``; return them as lists of str and bytes."""
    key_list = validate_keys(keys)
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise DistTypeError(f"values must be a list of bytes or str, not {type(values).__name__}")
    if len(values) != len(key_list):
        raise DistValueError(f"multi_set got {len(key_list)} keys but {len(values)} values")
    return key_list, [as_bytes(v, "each of values") for v in values]


def check_amount(amount: object) -> int:
    """Validate the ``amount`` of ``add``."""
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise DistTypeError(f"amount must be an int, not {type(amount).__name__}")
    if not INT64_MIN <= amount <= INT64_MAX:
        raise DistValueError(f"amount {amount} does not fit in 64 bits")
    return amount


def parse_counter(key: str, value: bytes) -> int:
    """The integer a counter key holds; ``DistValueError`` when it holds something else."""
    try:
        return int(value)
    except ValueError:
        raise DistValueError(f"add({key!r}): the current value {value[:40]!r} is not an integer") from None


def keys_timeout_error(op: str, missing: Sequence[str], timeout: float, where: str) -> DistTimeoutError:
    """The ``DistTimeoutError`` of a wait that ran out of time, naming (up to 20 of) the missing keys."""
    shown = ", ".join(repr(k) for k in missing[:20])
    more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
    noun = "key" if len(missing) == 1 else "keys"
    return DistTimeoutError(f"{op} timed out after {timeout:g} s waiting for {noun} {shown}{more} ({where})")
