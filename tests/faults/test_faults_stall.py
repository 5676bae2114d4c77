"""A rank stalled past the timeout in the middle of a large transfer (FAULTS rows 35, 36).

Rank 1's event loop is blocked for 2.5 T once, in the middle of a message: between two chunks
of a single-copy read (``process_vm_readv``), between two pieces through the shared-memory
ring (``AIODIST_SHM=copy``), or between two reads of a TCP frame's payload (``AIODIST_SHM=0``):
what a SIGSTOP or a task hogging the loop does. Meanwhile rank 0's operation times out and its
program reuses its buffer at once. Both ranks catch the error and carry on, as a user's program
would. The contract:

* an operation that returns success returned exact data (never the sender's next contents);
* an operation that raised leaves nothing behind: no later write into its buffers, nothing of
  it delivered to a later operation: a send retried after a timeout arrives once, in its place.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.scripts import run_ranks

pytestmark = pytest.mark.timeout(150)

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys, time
    import numpy as np
    import aiodist as dist

    kind, path = sys.argv[1], sys.argv[2]
    T = 1.0
    # broadcast: 3 chunks of 8 MiB. p2p: 4 MiB; over TCP more than the kernel's socket buffers
    # can hold (loopback autotunes a receive buffer up to tcp_rmem's 32 MiB here), so that the
    # send is still in flight when the receiver stalls.
    N = (24 << 20) // 4 if kind == "broadcast" else ((64 << 20) if path == "tcp" else (4 << 20)) // 4
    STEPS = 10

    def stall_at(nth_call):
        # Block the loop for 2.5 T at the nth call of the transport's copy step.
        calls = [0]
        def hook():
            calls[0] += 1
            if calls[0] == nth_call:
                print("STALL", flush=True)
                time.sleep(2.5 * T)
        if path == "single-copy":
            import aiodist.transport.shm as shm
            real_read = shm.cma_read
            def read(pid, addr, dst):
                hook()
                return real_read(pid, addr, dst)
            shm.cma_read = read
        elif path == "ring":
            import aiodist.transport.shm as shm
            real_piece = shm._Link._piece
            def piece(self, payload):
                hook()
                return real_piece(self, payload)
            shm._Link._piece = piece
        else:
            import aiodist.transport.tcp as tcp
            real_update = tcp._PeerProtocol.buffer_updated
            def update(self, nbytes):
                if self._reader.receiving_payload:
                    hook()
                return real_update(self, nbytes)
            tcp._PeerProtocol.buffer_updated = update

    async def untouched(buf, before):
        # After an operation raised, nothing more may be written into its buffer.
        await asyncio.sleep(0.5)
        return bool((buf == before).all())

    async def main():
        await dist.init_process_group("tcp", timeout=30)
        rank = dist.get_rank()
        g = await dist.new_group(timeout=T)
        if rank == 1:
            stall_at({"single-copy": 5, "ring": 30, "tcp": 20}[path])
        wrong, errors, touched = [], 0, 0
        buf = np.zeros(N, np.int32)  # one buffer, reused step after step
        step = 0
        while step < STEPS:
            if kind == "broadcast":
                buf[:] = step if rank == 0 else -1
                op = lambda: dist.broadcast(buf, 0, group=g)
            else:
                buf[:] = step if rank == 0 else -1
                op = (lambda: dist.send(buf, 1, group=g)) if rank == 0 else (lambda: dist.recv(buf, 0, group=g))
            try:
                await op()
                if not (buf == step).all():
                    wrong.append((step, sorted(set(np.unique(buf).tolist()))[:4]))
                step += 1
            except dist.DistError as exc:
                errors += 1
                print("ERROR", step, type(exc).__name__, str(exc)[:300], flush=True)
                if rank == 0:
                    buf[:] = 1000  # the sender's buffer is its own again: reused at once
                else:
                    touched += not await untouched(buf, buf.copy())
                if kind == "broadcast":  # collectives: agree where to go on
                    for _ in range(5):
                        try:
                            step = (await dist.resync(g)).next_op
                            break
                        except dist.DistTimeoutError:
                            pass
                # point-to-point: both sides simply try the same message again
        print("RESULT", rank, "wrong", wrong, "errors", errors, "touched", touched, "step", step, flush=True)
        await dist.barrier()
        await dist.destroy_process_group()

    asyncio.run(main())
    """
)

PATHS = {"single-copy": "1", "ring": "copy", "tcp": "0"}


def _run(tmp_path: Path, kind: str, path: str) -> list[str]:
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT)
    ran = run_ranks(script, 2, args=[kind, path], env={"AIODIST_SHM": PATHS[path]}, timeout=120)
    for r in ran:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "STALL" in ran[1].stdout, "the stall did not happen: the test proves nothing"
    return [r.results()[0] for r in ran]


@pytest.mark.parametrize("path", list(PATHS))
def test_broadcast_never_returns_the_roots_later_data(tmp_path: Path, path: str) -> None:
    """FAULTS row 35: the stalled receiver's broadcast raises rather than return a mix of what
    the root sent and what it wrote into its buffer after its own broadcast timed out."""
    root, receiver = _run(tmp_path, "broadcast", path)
    for line in (root, receiver):
        assert " wrong [] " in line and " touched 0 " in line and line.endswith("step 10"), line
    assert " errors 0 " not in receiver, receiver  # (the stall did cost an operation)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_send_retried_after_its_timeout_arrives_once(tmp_path: Path, path: str) -> None:
    """FAULTS row 36: a send that raised DistTimeoutError delivered nothing, so the program's
    retry is the one message received: no receive gets a message twice or out of its place."""
    sender, receiver = _run(tmp_path, "p2p", path)
    for line in (sender, receiver):
        assert " wrong [] " in line and " touched 0 " in line and line.endswith("step 10"), line
    assert " errors 0 " not in sender, sender  # its send timed out at least once
