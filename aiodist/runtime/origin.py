"""Where an operation comes from: the task or thread that called it, named alike on every rank.

Collectives on a group are matched across ranks by call order. Within one asyncio task (or
one thread) that order is the program's own; between tasks it is the scheduler's, which may
differ from rank to rank. So every collective's fingerprint carries its *origin*, a name for
the calling task that is equal on every rank running the same program: ranks that pair
operations of different tasks raise ``CollectiveMismatchError`` instead of exchanging each
other's data.

How a task is named: by its lineage. The k-th task of coroutine ``worker`` that task P
creates is ``P/worker[k]``, so sibling tasks started in the same order get the same names on
every rank, whatever the scheduler does with them afterwards. The name is kept in a context
variable, which the task factory installed by ``install`` sets when a task is created (a
Task runs in its own copy of its creator's context). Tasks that aiodist creates for itself
take their creator's name, so that the runtime's own bookkeeping never shifts a count. A
task created before the factory was installed (the one ``asyncio.run`` started) is named
after its coroutine, a thread after its name (``mark_thread``), and tasks created outside any
task (in a plain callback) are counted under ``loop``.

Threads are told apart by the names their programs give them: the main thread, aiodist's own
threads (``aiodist-...``) and threads with the names Python or a C library gives
(``Thread-3 (worker)``, ``Dummy-1``, an executor's ``ThreadPoolExecutor-0_1``, ``asyncio_0``)
are one anonymous origin, because libraries choose them as they please (torch's DDP starts a
bucket's all_reduce from the thread that completed the previous one's future, which differs
from rank to rank, in the same order) and the numbers in such names count every thread (or
executor) the process started.

Ranks may also run different code on purpose (a learner publishing to actors, a thread named
after its rank), where names differ with no race at all. So differing origins are a mismatch
only where they show a race (``OriginBook.clash``, the group's ``task_check``): under "auto"
(the default), when the sender's task or thread has itself started collectives on the group on
the receiving rank, when the two are tasks of one coroutine started by one parent (siblings:
``main/worker[0]`` and ``main/worker[1]``), or threads whose names differ only in their numbers
of which the other one runs here too; "strict" compares every name, "off" none (torch's way).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import os
import re
import threading
import zlib
from collections.abc import Collection, Coroutine, Generator
from typing import Any

from aiodist.errors import DistValueError

__all__ = [
    "MAX_NAME",
    "TASK_CHECKS",
    "Lineage",
    "OriginBook",
    "current",
    "install",
    "mark_thread",
    "root_context",
]

MAX_NAME = 80
"""Longest origin name sent as is; a longer one keeps its last parts behind a hash of the whole."""

# Coroutines defined under this directory are aiodist's own: their tasks are not counted.
_AIODIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class Lineage:
    """One task's (or thread's) place among the tasks of the program, and the count of its
    children by coroutine. Lives in the context variable of the task it names."""

    __slots__ = ("_name", "children", "label", "parent", "thread")

    def __init__(self, parent: Lineage | None, label: str, thread: int | None = None) -> None:
        self.parent = parent
        self.label = label
        self.children: dict[str, int] = {}
        self._name: str | None = None
        # A thread's mark (``mark_thread``): the thread that made it. It names what that thread
        # hands to another thread's loop; on its own thread, a task it runs later names itself.
        self.thread = thread

    def marks_this_thread(self) -> bool:
        return self.thread is not None and self.thread == threading.get_ident()

    def child(self, coroutine: str) -> Lineage:
        """The lineage of the next task of ``coroutine`` this one creates."""
        k = self.children.get(coroutine, 0)
        self.children[coroutine] = k + 1
        return Lineage(self, f"{coroutine}[{k}]")

    @property
    def name(self) -> str:
        """``main/worker[1]``; at most ``MAX_NAME`` characters (computed once)."""
        if self._name is None:
            parts: list[str] = []
            node: Lineage | None = self
            while node is not None:
                if node.label:  # (an unnamed thread's is empty)
                    parts.append(node.label)
                node = node.parent
            self._name = _bounded("/".join(reversed(parts)))
        return self._name


def _bounded(full: str) -> str:
    if len(full) <= MAX_NAME:
        return full
    digest = hashlib.blake2s(full.encode(), digest_size=4).hexdigest()
    tail = full[-(MAX_NAME - len(digest) - 2) :]
    return f"{digest}…{tail}"


_LINEAGE: contextvars.ContextVar[Lineage | None] = contextvars.ContextVar("aiodist_origin", default=None)

# Names that a program did not choose: the main thread's, aiodist's, Python's defaults, C threads',
# and the workers of executors (concurrent.futures' default names, asyncio's default executor).
_UNNAMED_THREAD = re.compile(
    r"MainThread|aiodist-.*|(Thread|Dummy)-\d+( \(.*\))?|ThreadPoolExecutor-\d+_\d+|asyncio_\d+"
)


def _coroutine_name(coro: Any) -> str:
    """``run.worker`` for the coroutine of ``async def worker`` nested in ``run``."""
    name = getattr(coro, "__qualname__", None)
    if not isinstance(name, str):
        name = type(coro).__qualname__
    return name.replace(".<locals>", "")


def current() -> str:
    """The origin of an operation started now: the calling task's (or thread's) name."""
    lineage = _LINEAGE.get()
    if lineage is not None and not lineage.marks_this_thread():
        return lineage.name
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        task = None
    if task is not None:  # created before ``install`` (or on a marked thread): its coroutine names it
        return _coroutine_name(task.get_coro())
    # a callback of the runtime's, or a thread's own call
    return "" if lineage is None else lineage.name


def mark_thread() -> None:
    """Name the calling thread's context after the thread, unless it already has an origin.

    For the places where a user's thread hands an operation to the runtime's loop: the loop
    runs it in a copy of this context, so the operation carries the thread's name (none for
    an unnamed thread: see the module's docstring).
    """
    if _LINEAGE.get() is None:
        name = threading.current_thread().name
        label = "" if _UNNAMED_THREAD.fullmatch(name) else f"thread {name}"
        _LINEAGE.set(Lineage(None, label, threading.get_ident()))


def root_context(label: str) -> contextvars.Context:
    """A copy of the current context whose tasks are named from ``label`` afresh (for ranks run
    as tasks of one loop: each rank's task is the root of its own lineage, named alike)."""
    ctx = contextvars.copy_context()
    ctx.run(_LINEAGE.set, Lineage(None, label))
    return ctx


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Name the tasks ``loop`` creates from now on by their lineage (idempotent).

    A task factory already set on the loop keeps running: it gets the context to use.
    """
    previous = loop.get_task_factory()
    if getattr(previous, "_aiodist_origin", False):
        return
    outside = Lineage(None, "loop")  # the creator of tasks started outside any task

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        code = getattr(coro, "cr_code", None)
        if code is None or not code.co_filename.startswith(_AIODIST_DIR):
            kwargs["context"] = _child_context(loop, coro, kwargs.get("context"), outside)
        elif _LINEAGE.get() is None:
            # aiodist's own task takes its creator's name through the copy of its creator's
            # context it runs in: a creator older than ``install`` is named first.
            _adopt(loop)
        if previous is None:
            return asyncio.Task(coro, loop=loop, **kwargs)
        return previous(loop, coro, **kwargs)

    factory._aiodist_origin = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


def _child_context(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any],
    given: contextvars.Context | None,
    outside: Lineage,
) -> contextvars.Context:
    parent = _LINEAGE.get()
    if given is not None and given.get(_LINEAGE) is not parent:
        return given  # a context chosen with its own origin (``root_context``): keep it
    if parent is not None and parent.marks_this_thread():
        parent = None  # (a loop this thread runs later names its tasks afresh)
    if parent is None:
        parent = _adopt(loop) or outside
    ctx = contextvars.copy_context() if given is None else given.copy()
    ctx.run(_LINEAGE.set, parent.child(_coroutine_name(coro)))
    return ctx


def _adopt(loop: asyncio.AbstractEventLoop) -> Lineage | None:
    """Name the running task, created before ``install``, after its coroutine from now on (this
    runs in its context), so that it counts its children; None outside any task."""
    creator = asyncio.current_task(loop)
    if creator is None:
        return None
    lineage = Lineage(None, _coroutine_name(creator.get_coro()))
    _LINEAGE.set(lineage)
    return lineage


# -- when differing origins are a mismatch ------------------------------------------------------

#: ``task_check``: when differing origins of paired collectives are a mismatch (``OriginBook``).
TASK_CHECKS = ("auto", "strict", "off")
_BOOK_SIZE = 64  # origins remembered per group (the most recent)
_SLOT_HASHES = 16  # of which a DETAIL slot carries this many
_COUNTS = re.compile(r"\[\d+\]")
_NUMBERS = re.compile(r"\d+")


def origin_hash(name: str) -> int:
    """A name's 32-bit hash, equal on every rank (for DETAIL slots)."""
    return zlib.crc32(name.encode())


def _siblings(a: str, b: str) -> bool:
    """Tasks of one coroutine started by one parent (``main/w[0]``, ``main/w[1]``), or threads
    whose names differ only in their numbers (``worker-0``, ``worker-1``) of which ``b`` runs
    here too: what a program that starts the same work several times names alike on every
    rank. (A thread named after its rank has no namesake of another rank's here.)"""
    if "…" in a or "…" in b:  # (cut names: their paths are not comparable)
        return False
    if a.startswith("thread ") and b.startswith("thread "):
        if _NUMBERS.sub("#", a) != _NUMBERS.sub("#", b):
            return False
        name = b[len("thread ") :]
        return any(t.name == name for t in threading.enumerate())
    return "[" in a and _COUNTS.sub("[]", a) == _COUNTS.sub("[]", b)


class OriginBook:
    """The tasks and threads that started collectives on one group on this rank, and the rule
    by which differing origins of paired operations are a mismatch (``task_check``)."""

    __slots__ = ("check", "names")

    def __init__(self, check: str = "auto") -> None:
        if check not in TASK_CHECKS:
            raise DistValueError(
                f"task_check must be one of {', '.join(map(repr, TASK_CHECKS))}, got {check!r}"
            )
        self.check = check
        self.names: dict[str, int] = {}  # name -> hash, in order of first use (bounded)

    def note(self, origin: str) -> None:
        """``origin`` starts a collective on the group here."""
        names = self.names
        if origin not in names:
            names[origin] = origin_hash(origin)
            if len(names) > _BOOK_SIZE:
                del names[next(iter(names))]

    def hashes(self) -> list[int]:
        """The most recent origins' hashes, for a DETAIL slot."""
        return list(self.names.values())[-_SLOT_HASHES:]

    def clash(self, mine: str, theirs: str) -> bool:
        """Whether an operation of ``mine`` here, paired with one of ``theirs`` on another rank,
        shows tasks racing on the group (the data path: this rank's knowledge)."""
        if mine == theirs or self.check == "off":
            return False
        return self.check == "strict" or theirs in self.names or _siblings(mine, theirs)

    def clash_in(self, table: dict[int, tuple[str, Collection[int]]], me: int) -> bool:
        """Whether the origins of one operation on every member (rank -> origin and the hashes of
        the origins its group has seen, as a DETAIL slot carries them) show tasks racing. Every
        member judges the same table alike (but for threads running here, ``_siblings``)."""
        if self.check == "off":
            return False
        ranks = sorted(table)
        for i, a in enumerate(ranks):
            for b in ranks[i + 1 :]:
                (oa, ha), (ob, hb) = table[a], table[b]
                if oa == ob:
                    continue
                if self.check == "strict" or origin_hash(oa) in hb or origin_hash(ob) in ha:
                    return True
                if (a == me and _siblings(oa, ob)) or (b == me and _siblings(ob, oa)):
                    return True
                if not oa.startswith("thread ") and _siblings(oa, ob):
                    return True  # (tasks: by their names alone, which every member sees)
        return False
