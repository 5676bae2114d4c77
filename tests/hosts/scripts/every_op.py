"""One rank of a multi-host job running the every-operation suite (``support.suite``).

Started by ``aiodist-run`` on each host of a bed. ``FACE`` is ``async`` (numpy arrays) or
``sync`` (``KIND``: torch tensors or numpy arrays); the object collectives run through the same
face. Before the group is destroyed the rank notes what the transport agreed on (the host
map, who shares memory, the bytes that went through shared memory) and which host-aware forms
ran (the ``aiodist`` logger's DEBUG notes); everything is pickled to ``$OUT_DIR/rank_<RANK>.pkl``.
"""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path
from typing import Any

import uvloop
from support.paths import HostAwarePaths
from support.suite import async_suite, every_object_operation, sync_object_operations, sync_suite


def transport_facts() -> dict[str, Any]:
    from aiodist.face import world

    transport = world.world().transport
    return {
        "hostname": socket.gethostname(),
        "host_keys": transport.host_keys,  # every rank's host, as the rendezvous agreed
        "shm_local": transport.shm_local,  # who reaches every rank of its host through shared memory
        "local_peers": transport.local_peers(),
        "shm_bytes": getattr(transport, "shm_bytes", (0, 0)),
    }


def main() -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    paths = HostAwarePaths().attach()
    if os.environ["FACE"] == "async":

        async def then() -> dict[str, Any]:
            return {**transport_facts(), "objects_async": await every_object_operation(rank, size)}

        res = uvloop.run(async_suite(rank, size, "tcp", ("numpy",), then=then))
    else:

        def then_sync() -> dict[str, Any]:
            return {**transport_facts(), "objects_sync": sync_object_operations(rank, size)}

        res = sync_suite(rank, size, "gloo", "cpu", False, os.environ["KIND"], then=then_sync)
    res["paths"] = sorted(paths.seen)
    Path(os.environ["OUT_DIR"], f"rank_{rank}.pkl").write_bytes(pickle.dumps(res))
    print(f"rank {rank} of {size} on {socket.gethostname()}: done", flush=True)


main()
