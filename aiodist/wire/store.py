"""The store protocol's constants: its handshake job name, and the limits each side reads with.

Shared by the server and the client (``aiodist.store``); the frames themselves are
``aiodist.wire.frames``.
"""

from __future__ import annotations

from aiodist.wire.frames import Limits

__all__ = [
    "CLIENT_LIMITS",
    "HANDSHAKE_LIMITS",
    "JOB",
    "MAX_KEY_BYTES",
    "MAX_REQUEST_KEYS",
    "MAX_VALUE_BYTES",
    "SERVER_LIMITS",
]

JOB = "aiodist-store"
MAX_VALUE_BYTES = 64 << 20
MAX_KEY_BYTES = 64 << 10
MAX_REQUEST_KEYS = 8192
# compare_set carries two values in one frame, hence twice the value limit.
SERVER_LIMITS = Limits(
    max_header=1 << 20,
    max_payload=2 * MAX_VALUE_BYTES,
    max_str=MAX_KEY_BYTES,
    max_bin=64,
    max_array=2 * MAX_REQUEST_KEYS,
    max_map=0,
)
# The client trusts the server it authenticated; a multi_get answer may exceed one value.
CLIENT_LIMITS = Limits(
    max_header=4 << 20,
    max_payload=1 << 40,
    max_str=MAX_KEY_BYTES,
    max_bin=64,
    max_array=2 * MAX_REQUEST_KEYS,
    max_map=0,
)
# Before authentication nothing but tiny handshake messages is accepted (nothing is allocated
# beyond the reader's small scratch buffer).
HANDSHAKE_LIMITS = Limits(max_header=1024, max_payload=0, max_str=512, max_bin=64, max_array=8, max_map=0)
