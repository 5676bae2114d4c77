"""init_process_group without a launcher: environment variables set by hand, or explicit arguments.

Two ways of telling a process who it is (a common walk-through of ``init_process_group``):
rank 0 passes ``rank=`` and ``world_size=`` to ``init_process_group``; every other rank sets
``RANK`` and ``WORLD_SIZE`` in ``os.environ`` and lets ``init_process_group`` read them.
Both set ``MASTER_ADDR``/``MASTER_PORT`` by hand, as one does when starting each rank's
script in its own terminal:

    python examples/init_by_hand.py 0 2 &     # "try_rank0.py"
    python examples/init_by_hand.py 1 2       # "try_rank1.py"

Without arguments it starts both itself. Only the import line differs from the
torch.distributed version (EXAMPLE_BACKEND=torch runs it on gloo).
"""

import os
import subprocess
import sys

if os.environ.get("EXAMPLE_BACKEND") == "torch":
    import torch.distributed as dist
else:
    import aiodist.sync as dist


def main(my_rank, my_world_size):
    # Set the master's address and port
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29501")
    if my_rank == 0:
        # Given to init_process_group directly
        dist.init_process_group(backend="gloo", rank=my_rank, world_size=my_world_size)
    else:
        # Set in the environment, picked up by init_process_group (init_method "env://")
        os.environ["RANK"] = str(my_rank)
        os.environ["WORLD_SIZE"] = str(my_world_size)
        dist.init_process_group(backend="gloo")
    # This process's rank and the number of processes
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    print(f"Rank: {rank}, World size: {world_size}", flush=True)
    # Everyone says hello to everyone: proof that the group really formed
    names = [None] * world_size
    dist.all_gather_object(names, f"hello from rank {rank}")
    print(f"Rank: {rank} heard {names}", flush=True)
    dist.destroy_process_group()  # release resources


if __name__ == "__main__":
    if len(sys.argv) == 3:
        main(int(sys.argv[1]), int(sys.argv[2]))
    else:
        world_size = 2
        procs = [
            subprocess.Popen([sys.executable, __file__, str(r), str(world_size)]) for r in range(world_size)
        ]
        raise SystemExit(max(abs(p.wait()) for p in procs))
