"""The staging pool's contract (reuse, size buckets, bound, close) and the one-device check,
without any transport."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.backends import staged as _staging
from aiodist.backends.staged import BufferPool

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None


# -- the pool ------------------------------------------------------------------------------------------


def _pool(**kw: Any) -> tuple[BufferPool, list[int]]:
    made: list[int] = []

    def alloc(n: int) -> Any:
        made.append(n)
        return np.empty(n, np.uint8)

    return BufferPool(alloc, **kw), made


def test_pool_size_buckets() -> None:
    pool, _ = _pool(min_bucket=4096)
    assert [pool.bucket(n) for n in (0, 1, 4096, 4097, 8192, 8193, 1 << 20)] == [
        4096,
        4096,
        4096,
        8192,
        8192,
        16384,
        1 << 20,
    ]
    with pytest.raises(ValueError, match="power of two"):
        _pool(min_bucket=3000)


def test_pool_reuses_a_released_buffer_of_the_same_bucket() -> None:
    pool, made = _pool()
    a = pool.acquire(5000)
    assert a.size == 8192 and pool.in_use_bytes == 8192 and made == [8192]
    buf = a.buf
    pool.release(a)
    assert pool.cached_bytes == 8192 and pool.in_use_bytes == 0
    b = pool.acquire(7000)  # same bucket: the same buffer, nothing allocated
    assert b.buf is buf and made == [8192] and pool.hits == 1
    c = pool.acquire(100)  # another bucket: a new one
    assert c.buf is not buf and made == [8192, 4096] and pool.misses == 2
    pool.release(b)
    pool.release(b)  # a second release is ignored
    assert pool.cached_bytes == 8192 and pool.in_use_bytes == 4096


def test_pool_cache_is_bounded_and_oversized_buffers_are_not_pooled() -> None:
    pool, made = _pool(max_cached_bytes=16384)
    blocks = [pool.acquire(8192) for _ in range(3)]
    for blk in blocks:
        pool.release(blk)
    assert pool.cached_bytes == 16384  # the third did not fit: dropped
    big = pool.acquire(20000)  # larger than the whole cache: exact size, never cached
    assert big.size == 20000 and not big.pooled and made[-1] == 20000
    pool.release(big)
    assert pool.cached_bytes == 16384 and pool.in_use_bytes == 0
    # a buffer something may still write into is discarded, never reused
    d = pool.acquire(8192)
    pool.discard(d)
    assert pool.cached_bytes == 8192 and pool.in_use_bytes == 0


def test_pool_close_frees_the_cache_and_refuses_more() -> None:
    pool, _ = _pool()
    a, b = pool.acquire(10), pool.acquire(10)
    pool.release(a)
    pool.close()
    assert pool.closed and pool.cached_bytes == 0
    pool.release(b)  # an operation finishing after close: dropped
    assert pool.cached_bytes == 0 and pool.in_use_bytes == 0
    with pytest.raises(dist.DistError, match="destroy_process_group"):
        pool.acquire(10)


def test_one_device_per_call() -> None:
    _staging.check_one_device([("a", np.zeros(1)), ("b", None), ("c", np.zeros(2))])
    if torch is not None:
        with pytest.raises(dist.DistValueError, match=r"output is on cpu but input\[1\] is on meta"):
            _staging.check_one_device(
                [
                    ("output", torch.zeros(1)),
                    ("input[0]", np.zeros(1)),
                    ("input[1]", torch.zeros(1, device="meta")),
                ]
            )
