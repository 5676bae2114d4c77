"""One rank of the host-aware forms' check: the same operations on the same data, whatever
``AIODIST_HOST_ALGOS`` says (``auto``: hierarchical across hosts; ``flat``: not).

Each rank's inputs are random, seeded by its rank, so the test can compute every result
itself; small buffers take the hierarchical forms, large ones the two-level forms and the
host-ordered chains. Writes ``$OUT_DIR/rank_<RANK>.npz`` (every result) and ``rank_<RANK>.paths`` (the
host-aware forms that ran, from the ``aiodist`` logger's DEBUG notes).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import uvloop
from support.paths import HostAwarePaths

import aiodist as dist

#: (name, elements): small ones take the hierarchical forms, large ones the two-level or host-ordered ones.
SIZES = (("small", 1001), ("large", 600_001))
DTYPES = ("float32", "float64", "int64")


def inputs(rank: int, n: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s input of ``n`` elements (the test calls this too)."""
    rng = np.random.default_rng(1000 + rank)
    if dtype == "int64":
        return rng.integers(-1000, 1000, n, dtype=np.int64)
    return rng.standard_normal(n).astype(dtype)


async def main() -> None:
    paths = HostAwarePaths().attach()
    await dist.init_process_group("tcp", timeout=60)
    rank, size = dist.get_rank(), dist.get_world_size()
    out: dict[str, np.ndarray] = {}
    for label, n in SIZES:
        for dtype in DTYPES:
            mine = inputs(rank, n, dtype)
            t = mine.copy()
            await dist.all_reduce(t)
            out[f"all_reduce/{label}/{dtype}"] = t
            t = mine.copy()
            await dist.all_reduce(t, dist.ReduceOp.MAX)
            out[f"all_reduce_max/{label}/{dtype}"] = t
            for root in range(size):
                t = mine.copy()
                await dist.broadcast(t, root)
                out[f"broadcast{root}/{label}/{dtype}"] = t
                t = mine.copy()
                await dist.reduce(t, root)
                if rank == root:
                    out[f"reduce{root}/{label}/{dtype}"] = t
            blocks = [np.empty_like(mine) for _ in range(size)]
            await dist.all_gather(blocks, mine)
            out[f"all_gather/{label}/{dtype}"] = np.stack(blocks)
    await dist.barrier()
    await dist.destroy_process_group()
    where = Path(os.environ["OUT_DIR"])
    np.savez(where / f"rank_{rank}.npz", **out)
    (where / f"rank_{rank}.paths").write_text("\n".join(sorted(paths.seen)))


if __name__ == "__main__":
    uvloop.run(main())
