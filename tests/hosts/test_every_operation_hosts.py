"""Every operation across hosts: real launchers on each host of a bed, values checked.

2 hosts x 2 ranks (the ranks of a host share memory, the hosts do not; the hierarchical forms
run) and 4 hosts x 1 rank (every byte over the bed's network; the flat forms run), on the
async face with numpy arrays and on the sync face with torch tensors; the object collectives
on both faces. Expected values derive from rank and size (``support.suite``).
"""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path
from typing import Any

import pytest
from support.suite import check_async_suite, check_object_operations, check_sync_suite

from hosts.conftest import MakeBed
from hosts.jobs import Job

pytestmark = pytest.mark.timeout(120)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def run_suite(
    make_bed: MakeBed, tmp_path: Path, hosts: int, nproc: int, face: str, kind: str = "numpy"
) -> list[dict[str, Any]]:
    bed = make_bed(hosts)
    job = Job(bed, "every_op.py", nproc=nproc, out_dir=tmp_path, env={"FACE": face, "KIND": kind}).start()
    codes = job.wait(100)
    assert codes == [0] * hosts, job.report()
    for node in job.nodes:  # each launcher relays its own workers' lines, with their ranks
        mine = range(node.rank * nproc, (node.rank + 1) * nproc)
        want = {f"[rank {r}]: rank {r} of {job.world_size} on {node.host.name}: done" for r in mine}
        assert set(node.stdout.splitlines()) == want, job.report()
    res = [pickle.loads((tmp_path / f"rank_{r}.pkl").read_bytes()) for r in range(job.world_size)]
    for r, out in enumerate(res):
        host = f"h{r // nproc}"
        assert out["hostname"] == host
        # the host map every rank agreed on: one key per host, the host name and boot id
        assert out["host_keys"] == tuple(f"h{k // nproc}/{BOOT_ID}" for k in range(job.world_size)), out[
            "host_keys"
        ]
        # shared memory only inside a host (/dev/shm is one file system for all of them)
        same_host = [k for k in range(job.world_size) if k // nproc == r // nproc and k != r]
        assert sorted(out["local_peers"]) == same_host, (r, out["local_peers"])
        sent, received = out["shm_bytes"]
        assert (sent > 0 and received > 0) == (nproc > 1), (r, out["shm_bytes"])
    return res


def test_async_face_on_two_hosts_of_two_ranks(make_bed: MakeBed, tmp_path: Path) -> None:
    res = run_suite(make_bed, tmp_path, 2, 2, "async")
    check_async_suite(res, 4, ("numpy",))
    for r, out in enumerate(res):
        check_object_operations(out["objects_async"], r, 4)
        # two hosts with two ranks each: the hierarchical forms, the two-level all_reduce and the
        # host-ordered chain for large buffers, the direct forms inside each host (its ranks
        # share memory)
        for path in ("all_reduce hierarchical", "all_reduce two-level", "broadcast hierarchical",
                     "broadcast host-ordered", "reduce hierarchical", "all_gather hierarchical",
                     "barrier hierarchical", "broadcast direct"):  # fmt: skip
            assert path in out["paths"], (r, path, out["paths"])


def test_async_face_on_four_hosts_of_one_rank(make_bed: MakeBed, tmp_path: Path) -> None:
    res = run_suite(make_bed, tmp_path, 4, 1, "async")
    check_async_suite(res, 4, ("numpy",))
    for r, out in enumerate(res):
        check_object_operations(out["objects_async"], r, 4)
        assert out["paths"] == [], out["paths"]  # one rank per host: nothing to gain, the flat forms


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.parametrize(("hosts", "per_host"), [(3, 1), (2, 2)], ids=["3x1", "2x2"])
def test_sync_face_with_torch_tensors(make_bed: MakeBed, tmp_path: Path, hosts: int, per_host: int) -> None:
    res = run_suite(make_bed, tmp_path, hosts, per_host, "sync", "torch")
    size = hosts * per_host
    check_sync_suite(res, size, "torch")
    for r, out in enumerate(res):
        check_object_operations(out["objects_sync"], r, size)
        # several ranks on a host: the hierarchical forms; one a host: the flat ones
        assert ("all_reduce hierarchical" in out["paths"]) == (per_host > 1), out["paths"]
