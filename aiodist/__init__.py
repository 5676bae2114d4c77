"""aiodist: the torch.distributed programming model on an event loop.

This module is the async face: every communication call starts its operation at once and
returns an awaitable ``Work``. ``aiodist.sync`` is the blocking, torch.distributed-compatible
face over the same runtime.
"""

from aiodist._p2p import P2POp as P2POp
from aiodist._p2p import barrier as barrier
from aiodist._p2p import batch_isend_irecv as batch_isend_irecv
from aiodist._p2p import irecv as irecv
from aiodist._p2p import isend as isend
from aiodist._p2p import recv as recv
from aiodist._p2p import send as send
from aiodist._world import WORLD as WORLD
from aiodist._world import destroy_process_group as destroy_process_group
from aiodist._world import get_backend as get_backend
from aiodist._world import get_rank as get_rank
from aiodist._world import get_world_size as get_world_size
from aiodist._world import init_process_group as init_process_group
from aiodist._world import is_initialized as is_initialized
from aiodist._world import new_group as new_group
from aiodist.errors import CollectiveMismatchError as CollectiveMismatchError
from aiodist.errors import DistError as DistError
from aiodist.errors import DistNetworkError as DistNetworkError
from aiodist.errors import DistStoreError as DistStoreError
from aiodist.errors import DistTimeoutError as DistTimeoutError
from aiodist.errors import DistTypeError as DistTypeError
from aiodist.errors import DistValueError as DistValueError
from aiodist.group import ProcessGroup as ProcessGroup
from aiodist.ops import ReduceOp as ReduceOp
from aiodist.ops import reduce_op as reduce_op
from aiodist.store import FileStore as FileStore
from aiodist.store import HashStore as HashStore
from aiodist.store import PrefixStore as PrefixStore
from aiodist.store import Store as Store
from aiodist.store import TCPStore as TCPStore
from aiodist.work import Work as Work

__version__ = "0.1.0"

__all__ = [
    "WORLD",
    "CollectiveMismatchError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "DistTypeError",
    "DistValueError",
    "FileStore",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "barrier",
    "batch_isend_irecv",
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce_op",
    "send",
]
