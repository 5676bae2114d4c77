"""The names collectives carry for the task or thread that started them (aiodist.runtime.origin),
and how disagreements about them read."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from typing import Any

import uvloop

import aiodist
from aiodist.runtime import origin
from aiodist.settings import Settings
from aiodist.transport.base import describe_disagreement
from aiodist.wire.fingerprint import ORDER_HINT, OpFingerprint


def _run(main: Any) -> Any:
    # (in a context of its own: this thread's may carry the name of an earlier test's thread)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main(), context=contextvars.Context())


async def leaf() -> str:
    return origin.current()


async def worker() -> list[str]:
    return [origin.current(), *await asyncio.gather(leaf(), leaf())]


async def main() -> list[Any]:
    origin.install(asyncio.get_running_loop())
    before = origin.current()  # this task predates the factory: named after its coroutine
    first = asyncio.create_task(worker())
    second = asyncio.create_task(worker())
    late = await second  # the order they finish in does not matter
    return [before, await first, late, origin.current()]


def test_tasks_are_named_by_lineage_in_creation_order() -> None:
    before, first, second, after = _run(main)
    assert before == after == "main"
    assert first == ["main/worker[0]", "main/worker[0]/leaf[0]", "main/worker[0]/leaf[1]"]
    assert second == ["main/worker[1]", "main/worker[1]/leaf[0]", "main/worker[1]/leaf[1]"]


def test_siblings_are_counted_per_coroutine() -> None:
    """A task of another coroutine started on one rank only does not shift the workers' names."""

    async def monitor() -> None:
        return None

    async def worker() -> str:
        return origin.current()

    async def main(extra: bool) -> list[str]:
        origin.install(asyncio.get_running_loop())
        if extra:
            await asyncio.create_task(monitor())
        return list(await asyncio.gather(worker(), worker()))

    assert _run(lambda: main(False)) == _run(lambda: main(True))


def test_aiodist_tasks_take_their_creators_name() -> None:
    """A task of aiodist's own (its coroutine defined under the package) is not counted: tasks
    it creates are named as children of the task that created it, whatever the runtime does."""
    # A coroutine "of aiodist": compiled under a file name in the package's directory.
    ns: dict[str, Any] = {"asyncio": asyncio}
    code = "async def runtime_step(make):\n    return await asyncio.create_task(make())\n"
    exec(compile(code, os.path.join(os.path.dirname(aiodist.__file__), "_step.py"), "exec"), ns)

    async def probe() -> str:
        return origin.current()

    async def main() -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        origin.install(loop)
        via_runtime = await loop.create_task(ns["runtime_step"](probe))
        direct = await asyncio.create_task(probe())
        return via_runtime, direct

    via_runtime, direct = _run(main)
    # Both are main's children, counted together (the long names keep their ends).
    assert via_runtime.endswith("main/test_aiodist_tasks_take_their_creators_name.probe[0]"), via_runtime
    assert direct.endswith("main/test_aiodist_tasks_take_their_creators_name.probe[1]"), direct
    assert "runtime_step" not in via_runtime


def test_install_is_idempotent_and_keeps_the_previous_factory() -> None:
    seen: list[Any] = []

    def previous(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        seen.append(kwargs.get("context"))
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def child() -> str:
        return origin.current()

    async def main() -> str:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(previous)
        origin.install(loop)
        factory = loop.get_task_factory()
        origin.install(loop)
        assert loop.get_task_factory() is factory
        return await asyncio.create_task(child())

    assert _run(main).endswith("/test_install_is_idempotent_and_keeps_the_previous_factory.child[0]")
    assert seen and seen[0] is not None  # the previous factory ran, with our context


def test_root_context_starts_a_lineage_alike_on_every_rank() -> None:
    async def rank() -> str:
        async def step() -> str:
            return origin.current()

        return await asyncio.create_task(step())

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        origin.install(loop)
        tasks = [loop.create_task(rank(), context=origin.root_context("rank")) for _ in range(3)]
        return list(await asyncio.gather(*tasks))

    names = _run(main)
    assert names == ["rank/test_root_context_starts_a_lineage_alike_on_every_rank.rank.step[0]"] * 3


def test_threads_are_named_after_themselves_unless_unnamed() -> None:
    names: list[str] = []

    def body() -> None:
        origin.mark_thread()
        names.append(origin.current())

    for th in (threading.Thread(target=body, name="loader"), threading.Thread(target=body)):
        th.start()
        th.join()
    assert names == ["thread loader", ""]  # Thread-N (body): a name the program did not choose


def test_a_thread_that_used_the_blocking_face_runs_a_loop_of_its_own_with_named_tasks() -> None:
    """A thread's mark names what it hands to the runtime's loop; a loop the thread itself runs
    later (``asyncio.run`` after blocking calls) names its tasks afresh, not after the mark."""
    got: list[Any] = []

    def body() -> None:
        origin.mark_thread()  # what a blocking call does
        handed = contextvars.copy_context()  # what the runtime's loop thread runs it in
        got.append(origin.current())
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            got.append(runner.run(main()))
        other = threading.Thread(target=lambda: got.append(handed.run(origin.current)))
        other.start()
        other.join()

    th = threading.Thread(target=body, name="trainer")
    th.start()
    th.join()
    mark, (before, first, _, after), on_another_thread = got
    assert mark == on_another_thread == "thread trainer"
    assert before == after == "main" and first[0] == "main/worker[0]"


def test_long_names_keep_their_end_behind_a_hash_of_the_whole() -> None:
    a = origin.Lineage(origin.Lineage(None, "x" * 100), "worker[0]")
    b = origin.Lineage(origin.Lineage(None, "y" * 100), "worker[0]")
    assert len(a.name) <= origin.MAX_NAME and a.name.endswith("/worker[0]")
    assert a.name != b.name


def test_a_disagreement_names_the_tasks_only_where_they_differ() -> None:
    ours = ["all_reduce", 3, "float32", 4, -1, "SUM", "main/worker[0]"]
    theirs = ["all_reduce", 3, "float32", 4, -1, "SUM", "main/worker[1]"]
    text = describe_disagreement(0, ours, 1, theirs)
    assert text == (
        "rank 0 expected all_reduce #3 (float32 x 4, sum) from task main/worker[0] but rank 1 sent "
        f"all_reduce #3 (float32 x 4, sum) from task main/worker[1]: {ORDER_HINT}"
    )
    other = ["broadcast", 3, "float32", 4, 0, None, "main/worker[0]"]
    assert describe_disagreement(0, ours, 1, other) == (
        "rank 0 expected all_reduce #3 (float32 x 4, sum) but rank 1 sent broadcast #3 (float32 x 4, root 0)"
    )
    both = ["broadcast", 3, "float32", 4, 0, None, "thread loader"]
    assert describe_disagreement(0, ours, 1, both).endswith("from thread loader")
    unnamed = ["all_reduce", 3, "float32", 4, -1, "SUM", ""]
    assert "from the main thread or an unnamed one: " in describe_disagreement(0, theirs, 1, unnamed)
    assert OpFingerprint.from_wire(["barrier", 0, "", 0, -1, None]) == OpFingerprint("barrier", 0)


def test_executor_workers_are_unnamed() -> None:
    """Executors number their workers per process (one rank may have made one more): no name."""
    import concurrent.futures

    def name_of() -> str:
        origin.mark_thread()
        return origin.current()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert contextvars.copy_context().run(lambda: pool.submit(name_of).result()) == ""


def test_auto_task_check_sees_a_race_only_where_names_show_one() -> None:
    book = origin.OriginBook("auto")
    book.note("main/publish[0]")
    # different coroutines (roles), threads named after their rank or role: no race
    assert not book.clash("main/publish[0]", "main/listen[0]")
    assert not book.clash("thread comm-rank0", "thread comm-rank1")
    assert not book.clash("thread learner", "thread actor")
    # tasks of one coroutine started by one parent: siblings, always compared
    assert book.clash("main/worker[0]", "main/worker[1]")
    assert book.clash("main/worker[0]/step[2]", "main/worker[1]/step[2]")
    assert not book.clash("main/worker[0]", "main/worker[0]")
    # a task or thread that started collectives on this group here too: the same program
    book.note("main/listen[0]")
    assert book.clash("main/publish[0]", "main/listen[0]")
    # threads whose names differ in their numbers: compared when the other one runs here too
    done = threading.Event()
    th = threading.Thread(target=done.wait, name="worker-1")
    th.start()
    try:
        assert book.clash("thread worker-0", "thread worker-1")
        assert not book.clash("thread worker-0", "thread worker-7")
    finally:
        done.set()
        th.join()


def test_strict_and_off_task_checks() -> None:
    strict, off = origin.OriginBook("strict"), origin.OriginBook("off")
    assert strict.clash("main/publish[0]", "main/listen[0]")
    assert not off.clash("main/worker[0]", "main/worker[1]")
    assert not strict.clash("main", "main")
    try:
        origin.OriginBook("sometimes")
    except ValueError as exc:
        assert "'auto', 'strict', 'off'" in str(exc)
    else:
        raise AssertionError("an unknown task_check was accepted")


def test_every_member_judges_a_detail_table_alike() -> None:
    """DETAIL slots carry the hashes of the origins each member's group has seen, so a member
    that never ran the other's task still sees the race the other one saw."""
    h = origin.origin_hash
    a, b = origin.OriginBook("auto"), origin.OriginBook("auto")
    a.note("main/load")
    a.note("main/train")
    b.note("main/train")
    table = {0: ("main/load", a.hashes()), 1: ("main/train", b.hashes())}
    assert a.clash_in(table, 0) and b.clash_in(table, 1)
    roles = {0: ("main/publish[0]", [h("main/publish[0]")]), 1: ("main/listen[0]", [h("main/listen[0]")])}
    assert not a.clash_in(roles, 0) and not b.clash_in(roles, 1)


def test_task_check_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("AIODIST_TASK_CHECK", "Strict")
    assert Settings.read().task_check == "strict"
    monkeypatch.setenv("AIODIST_TASK_CHECK", "")
    assert Settings.read().task_check == "auto"
    monkeypatch.setenv("AIODIST_TASK_CHECK", "maybe")
    try:
        Settings.read()
    except ValueError as exc:
        assert "AIODIST_TASK_CHECK" in str(exc)
    else:
        raise AssertionError("a bad AIODIST_TASK_CHECK was accepted")
