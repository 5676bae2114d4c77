"""Every operation over every path an operation takes, in one parametrised suite:
transport (memory, TCP, shared memory between processes of one host) x face (async, sync) x tensor kind (numpy, torch CPU) x staging (none,
host-staged). Host staging is the CUDA path on CPU: ``HostStager`` has ``CudaStager``'s contract
and poisons its twins, so right results mean every input was copied in and every output copied
back. The suite itself is ``support.suite``.

The sync face blocks its caller, so it runs one process per rank: over TCP and shared memory
only. The memory cases are the fast tier (``collectives``); the others spawn real processes
(``integration``). "tcp" turns shared memory off (``AIODIST_SHM=0``); "shm" asserts that every
rank's data really went through it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
from typing import Any

import pytest
from support.suite import (
    async_suite,
    check_async_suite,
    check_every_operation,
    check_sync_suite,
    memory_suite,
    sync_suite,
)

from aiodist.testing import spawn

pytestmark = pytest.mark.timeout(150)

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _cases() -> list[Any]:
    cases = []
    for transport, face, kind, staging in itertools.product(
        ("memory", "tcp", "shm"), ("async", "sync"), ("numpy", "torch"), ("none", "host")
    ):
        if transport == "memory" and face == "sync":
            continue  # the sync face blocks: one process per rank
        marks = [pytest.mark.collectives if transport == "memory" else pytest.mark.integration]
        if kind == "torch" and not HAVE_TORCH:
            marks.append(pytest.mark.skip(reason="torch not installed"))
        cases.append(
            pytest.param(
                transport, face, kind, staging, marks=marks, id=f"{transport}-{face}-{kind}-{staging}"
            )
        )
    return cases


def _check_stager(out: dict[str, Any]) -> None:
    copies_in, copies_out, hits, in_use = out["stager"]
    assert copies_in > 0 and copies_out > 0 and hits > 0 and in_use == 0, out["stager"]


@pytest.mark.parametrize(("transport", "face", "kind", "staging"), _cases())
def test_every_operation(transport: str, face: str, kind: str, staging: str) -> None:
    stage = staging == "host"
    if transport == "memory":
        for n in (1, 2, 3):
            res = asyncio.run(memory_suite(n, kind, stage))
            for r, out in enumerate(res):
                check_every_operation(out, r, n, (kind, staging))
                if stage:
                    _check_stager(out)
        return
    env = {"AIODIST_SHM": "0"} if transport == "tcp" else {"AIODIST_SHM": "1"}
    if face == "async":
        # 3 ranks (4 for torch tensors): rings, trees and the odd member of a subgroup
        n = 2 if stage else (3 if kind == "numpy" else 4)
        res = spawn(async_suite, n, args=("tcp", (kind,), stage), timeout=130, env=env)
        check_async_suite(res, n, (kind,))
    else:
        n = 2 if stage else 3
        res = spawn(
            sync_suite, n, args=("tcp" if stage else "gloo", "cpu", stage, kind), timeout=130, env=env
        )
        check_sync_suite(res, n, kind)
    for out in res:
        sent, received = out["shm_bytes"]
        if transport == "shm":  # every rank's data went through shared memory (MiBs on the async face)
            least = 1 << 20 if face == "async" else 1
            assert sent >= least and received >= least, out["shm_bytes"]
        else:
            assert (sent, received) == (0, 0), out["shm_bytes"]
    if stage:
        for out in res:
            _check_stager(out)
            assert out["pool_after_destroy"] == (True, 0)
