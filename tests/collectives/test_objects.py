"""Object collectives: msgpack for plain data, pickle only from authenticated peers or with
``AIODIST_ALLOW_PICKLE=1``; a refused pickle payload is never unpickled."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import aiodist as dist
from aiodist.errors import DistError, DistValueError
from aiodist.face.object_collectives import decode_object, encode_object
from aiodist.group import ProcessGroup
from aiodist.testing import run_memory_world, spawn

pytestmark = pytest.mark.timeout(90)

PLAIN: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    1.5,
    float("inf"),
    "",
    "héllo",
    b"\x00\xff",
    [1, [2, [3]]],
    (1, (2, "x")),
    {"a": 1, 2: [None], (1, 2): {"t": (3,)}},
    [],
    (),
    {},
]


@dataclass
class Point:
    x: int
    y: float


def _touch(path: str) -> None:
    pathlib.Path(path).write_text("unpickled")


class Evil:
    """Unpickling this writes a marker file: proof that a payload was (or was not) unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (_touch, (self.marker,))


def test_plain_data_is_msgpack_and_round_trips() -> None:
    for obj in PLAIN:
        payload = encode_object(obj)
        assert payload[:1] == b"M", obj
        back = decode_object(payload, src=0, allow_pickle=False, what="test")
        assert back == obj and type(back) is type(obj)
    assert encode_object(Point(1, 2.0))[:1] == b"P"
    assert encode_object(2**70)[:1] == b"P"  # beyond msgpack's integers
    assert encode_object(np.float64(1.0))[:1] == b"P"  # a float subclass is not plain data


def test_refused_pickle_is_never_unpickled(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "marker"
    payload = encode_object(Evil(str(marker)))
    with pytest.raises(DistError, match="AIODIST_ALLOW_PICKLE") as info:
        decode_object(payload, src=3, allow_pickle=False, what="broadcast_object_list")
    assert "rank 3" in str(info.value)
    assert not marker.exists()
    decode_object(payload, src=3, allow_pickle=True, what="x")
    assert marker.exists()


@pytest.mark.parametrize("n", [1, 2, 3, 5])
async def test_object_collectives_memory(n: int) -> None:
    async def fn(g: ProcessGroup) -> None:
        r = g.rank
        for root in range(n):
            objs: list[Any] = list(PLAIN) if r == root else [None] * len(PLAIN)
            await dist.broadcast_object_list(objs, root, group=g)
            assert objs == PLAIN and [type(o) for o in objs] == [type(o) for o in PLAIN]
            got: list[Any] | None = [None] * n if r == root else None
            await dist.gather_object({"from": r, "data": "x" * (r * 100)}, got, root, group=g)
            if got is not None:
                assert got == [{"from": i, "data": "x" * (i * 100)} for i in range(n)]
            out: list[Any] = [None]
            await dist.scatter_object_list(
                out, [(i, "y" * i) for i in range(n)] if r == root else None, root, group=g
            )
            assert out == [(r, "y" * r)]
        every: list[Any] = [None] * n
        await dist.all_gather_object(every, [r] * (r * 1000), group=g)  # uneven sizes
        assert every == [[i] * (i * 1000) for i in range(n)]
        if n > 1:
            if r == 0:
                await dist.send_object_list([1, "two", (3,)], 1, group=g)
                await dist.send_object_list([{"k": b"v"}], 1, group=g)
            elif r == 1:
                first: list[Any] = [None] * 3
                second: list[Any] = [None]
                w1 = dist.recv_object_list(first, None, group=g)
                w2 = dist.recv_object_list(second, 0, group=g)
                assert await w1 == 0 and await w2 == 0
                assert first == [1, "two", (3,)] and second == [{"k": b"v"}]

    await run_memory_world(n, fn)


async def test_object_argument_errors() -> None:
    async def fn(g: ProcessGroup) -> None:
        with pytest.raises(DistValueError, match="one slot per group member"):
            dist.all_gather_object([None], 1, group=g)
        with pytest.raises(DistValueError, match="object_gather_list is required"):
            dist.gather_object(1, None, g.rank, group=g)
        with pytest.raises(DistValueError, match="list of size at least 1"):
            dist.scatter_object_list([], [1, 2], 0, group=g)
        with pytest.raises(dist.DistTypeError, match="object_list must be a list"):
            dist.broadcast_object_list((1, 2), 0, group=g)  # type: ignore[arg-type]

    await run_memory_world(2, fn)


async def test_pickle_refused_without_opt_in_memory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AIODIST_ALLOW_PICKLE", raising=False)
    marker = tmp_path / "marker"

    async def fn(g: ProcessGroup) -> str:
        objs: list[Any] = [Evil(str(marker))] if g.rank == 0 else [None]
        try:
            await dist.broadcast_object_list(objs, 0, group=g)
        except DistError as exc:
            return str(exc)
        return "ok"

    res = await run_memory_world(2, fn)
    assert "not unpickled" in res[1] and "AIODIST_SECRET" in res[1]
    assert not marker.exists()

    monkeypatch.setenv("AIODIST_ALLOW_PICKLE", "1")

    async def allowed(g: ProcessGroup) -> Any:
        objs: list[Any] = [Point(g.rank, 0.5)]
        await dist.broadcast_object_list(objs, 1, group=g)
        return objs[0]

    assert await run_memory_world(2, allowed) == [Point(1, 0.5), Point(1, 0.5)]


# -- over TCP: authenticated peers may pickle, others may not --------------------------------------------


async def _tcp_objects(rank: int, size: int, marker: str) -> dict[str, Any]:
    await dist.init_process_group("tcp", "env://", timeout=30)
    out: dict[str, Any] = {}
    plain: list[Any] = list(PLAIN) if rank == 0 else [None] * len(PLAIN)
    await dist.broadcast_object_list(plain, 0)
    out["plain"] = plain == PLAIN
    # A refused payload fails the operation (and may break its group): one group per case.
    custom: list[Any] = [Point(rank, 1.5)] * size
    try:
        await dist.all_gather_object(custom, Point(rank, 1.5), group=await dist.new_group())
        out["custom"] = custom == [Point(i, 1.5) for i in range(size)]
    except DistError as exc:
        out["custom"] = str(exc)
    evil: list[Any] = [Evil(marker)] if rank == 0 else [None]
    try:
        await dist.broadcast_object_list(evil, 0, group=await dist.new_group())
        out["evil"] = "accepted"
    except DistError as exc:
        out["evil"] = str(exc)
    await dist.barrier()
    await dist.destroy_process_group()
    return out


@pytest.mark.integration  # real processes over TCP: not in the fast tier
def test_tcp_pickle_needs_authentication(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "marker"
    env = {"AIODIST_SECRET": "", "AIODIST_ALLOW_PICKLE": "0"}
    res = spawn(_tcp_objects, 2, args=(str(marker),), env=env, timeout=60)
    assert all(r["plain"] for r in res)
    assert "AIODIST_ALLOW_PICKLE" in res[1]["evil"] and "not unpickled" in res[1]["evil"]
    assert "needs pickle" in str(res[0]["custom"]) or "needs pickle" in str(res[1]["custom"])
    assert not marker.exists()

    res = spawn(_tcp_objects, 2, args=(str(marker),), env={"AIODIST_SECRET": "s3cret-for-tests"}, timeout=60)
    assert all(r["plain"] and r["custom"] is True for r in res)
    assert res[1]["evil"] == "accepted" and marker.exists()  # authenticated peers may pickle


def test_env_is_clean() -> None:
    assert os.environ.get("AIODIST_ALLOW_PICKLE", "") != "1", "tests must not leak the opt-in"


async def test_announced_object_size_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer cannot make us allocate whatever it announces: over the cap is a clear error."""
    monkeypatch.setenv("AIODIST_MAX_OBJECT_BYTES", "1000")

    async def fn(g: ProcessGroup) -> Any:
        objs: list[Any] = ["x" * 5000] if g.rank == 0 else [None]
        try:
            await dist.broadcast_object_list(objs, src=0, group=g)
        except DistError as exc:
            return str(exc)
        return "no error"

    res = await run_memory_world(2, fn)
    assert "rank 0 announced 5" in res[1] and "AIODIST_MAX_OBJECT_BYTES" in res[1]
