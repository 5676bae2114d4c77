# cython: language_level=3
"""The compiled twin of ``aiodist.work.Work`` (and of its ``_Waiting``): the same handle, in C.

Every operation returns a Work and most are awaited, so its making, awaiting and dropping are
on every operation's path: in Python they are half a dozen frames (the constructor, the
``__await__`` generator, the stand-in future the task waits on and its methods, the finaliser).
Here they are C, with the same behaviour word for word; ``tests/unit/test_native_work.py``
gives both twins the same operations and demands the same outcomes, warnings and log records.
What happens rarely stays in Python and is shared (``aiodist.work``: the report of a Work
dropped unseen, the wait of a thread): ``bind`` hands it over when ``aiodist.work`` loads.
"""

import asyncio
import concurrent.futures
import datetime

from aiodist.errors import DistError, DistTimeoutError

__all__ = ["Work", "bind"]

cdef int _UNSEEN = 0
cdef int _LOOKED = 1
cdef int _TAKEN = 2

cdef object _dropped = None
cdef object _wait_future = None
cdef object _get_running_loop = asyncio._get_running_loop


def bind(dropped, wait_future):
    """``aiodist.work`` hands over what the twins share: the report of a Work dropped unseen,
    and the wait of a thread for a loop's future."""
    global _dropped, _wait_future
    _dropped = dropped
    _wait_future = wait_future


cdef class _Waiting:
    """What a task awaiting a Work on the runtime's loop waits on (see ``aiodist.work._Waiting``)."""

    cdef public bint _asyncio_future_blocking
    cdef object _op
    cdef object _loop
    cdef object _wakeup
    cdef object _context
    cdef public object cancelled_msg

    def __init__(self, op, loop):
        self._op = op
        self._loop = loop
        self._asyncio_future_blocking = True
        self._wakeup = None
        self._context = None
        self.cancelled_msg = None

    def get_loop(self):
        return self._loop

    def done(self):
        return self.cancelled_msg is not None or self._op.done()

    def cancelled(self):
        return self.cancelled_msg is not None

    def add_done_callback(self, fn, *, context=None):
        self._wakeup, self._context = fn, context
        self._op.add_done_callback(fn, context=context)

    def remove_done_callback(self, fn):
        return self._op.remove_done_callback(fn)

    def cancel(self, msg=None):
        if self.cancelled_msg is not None or self._op.done():
            return False
        self._op.remove_done_callback(self._wakeup)
        self.cancelled_msg = () if msg is None else (msg,)
        self._loop.call_soon(self._wakeup, self, context=self._context)
        return True

    def result(self):
        if self.cancelled_msg is not None:
            raise asyncio.CancelledError(*self.cancelled_msg)
        return self._op.result()

    def exception(self):
        if self.cancelled_msg is not None:
            raise asyncio.CancelledError(*self.cancelled_msg)
        return self._op.exception()


cdef class Work:
    """Handle of one started operation.

    Args:
        future: completes with the operation's result (None, or the source rank for recv).
        name: what the operation is, for error messages ("all_reduce #17 on rank 2").
    """

    cdef public object _future
    cdef public object _loop
    cdef public object _cf
    cdef public int _seen
    cdef public object _started_at
    cdef public object name

    def __init__(self, future, name):
        self._future = future
        self._loop = future.get_loop()
        self._cf = None
        self._seen = _UNSEEN
        self.name = name
        self._started_at = None

    def __del__(self):
        if self._seen != _TAKEN and _dropped is not None:
            _dropped(self._future, self.name, self._seen, self._loop, self._started_at)

    @classmethod
    def completed(cls, loop, name, result=None):
        fut = loop.create_future()
        fut.set_result(result)
        return cls(fut, name)

    @classmethod
    def failed(cls, loop, name, exc):
        fut = loop.create_future()
        fut.set_exception(exc)
        return cls(fut, name)

    def __repr__(self):
        state = "done" if self._future.done() else "pending"
        return f"<Work {self.name} {state}>"

    # -- asyncio -------------------------------------------------------------------------
    def __await__(self):
        fut = self._future
        if not fut.done():
            self._seen = _LOOKED
            loop = _get_running_loop()
            if loop is self._loop:
                waiting = _Waiting(fut, loop)
                try:
                    yield waiting
                except BaseException:
                    if waiting.cancelled_msg is None:
                        self._seen = _TAKEN
                    raise
                if waiting.cancelled_msg is not None:
                    raise asyncio.CancelledError(*waiting.cancelled_msg)
            else:
                yield from asyncio.wrap_future(self.get_future()).__await__()
        self._seen = _TAKEN
        return fut.result()

    # -- state ---------------------------------------------------------------------------
    def is_completed(self):
        """True once the operation has finished, successfully or not."""
        if self._seen == _UNSEEN:
            self._seen = _LOOKED
        return self._future.done()

    def is_success(self):
        """True once the operation has finished without error."""
        fut = self._future
        self._seen = _TAKEN if fut.done() else max(self._seen, _LOOKED)
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def exception(self):
        """The operation's error, or None (also None while it runs)."""
        fut = self._future
        if not fut.done():
            self._seen = max(self._seen, _LOOKED)
            return None
        self._seen = _TAKEN
        if fut.cancelled():
            return DistError(f"{self.name} was cancelled")
        return fut.exception()

    def result(self):
        """The operation's result; raises its error. Only valid once completed."""
        if not self._future.done():
            self._seen = max(self._seen, _LOOKED)
            raise DistError(f"{self.name} has not completed yet")
        self._seen = _TAKEN
        return self._future.result()

    # -- threads -------------------------------------------------------------------------
    def wait(self, timeout=None):
        """Block this thread until the operation completes; raise its error if it failed.

        Args:
            timeout: seconds (or torch's ``timedelta``; ``timedelta(0)`` means no limit) to wait
                at most. When it runs out, ``DistTimeoutError`` is raised and the operation keeps
                running.
        Returns:
            True, as torch's ``Work.wait``.
        Raises:
            DistError: from a thread running the runtime loop (it would deadlock).
        """
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds() or None
        if self._future.done():
            self.result()
            return True
        self._seen = max(self._seen, _LOOKED)
        if self._on_loop_thread():
            raise DistError(f"Work.wait() for {self.name} called on the runtime's loop thread; use 'await work'")
        try:
            done, _ = _wait_future(self._loop, self._future, timeout)
        except asyncio.CancelledError:
            self._seen = _TAKEN
            raise DistError(f"{self.name} was cancelled") from None
        except BaseException:
            if self._future.done():
                self._seen = _TAKEN
            raise
        if not done:
            raise DistTimeoutError(f"{self.name} did not complete within {timeout} s (it is still running)")
        self._seen = _TAKEN
        return True

    def get_future(self):
        """A thread-safe future completing with the operation."""
        self._seen = _TAKEN
        if self._cf is None:
            cf = concurrent.futures.Future()
            self._cf = cf
            if self._future.done():
                self._copy_to_cf(self._future)
            elif self._on_loop_thread():
                self._future.add_done_callback(self._copy_to_cf)
            else:
                self._loop.call_soon_threadsafe(self._future.add_done_callback, self._copy_to_cf)
        return self._cf

    def _copy_to_cf(self, fut):
        cf = self._cf
        if cf.done():
            return
        if fut.cancelled():
            cf.set_exception(DistError(f"{self.name} was cancelled"))
        elif fut.exception() is not None:
            cf.set_exception(fut.exception())
        else:
            cf.set_result(fut.result())

    def _on_loop_thread(self):
        return _get_running_loop() is self._loop

    # torch compatibility
    def source_rank(self):
        """The sender of a completed ``recv``/``irecv`` (torch's ``Work.source_rank``)."""
        return int(self.result())

    def _source_rank(self):
        """The same as ``source_rank`` (torch's suite and some user code call this spelling)."""
        return int(self.result())

    def synchronize(self):
        """No-op for host tensors (torch uses it for CUDA streams)."""
