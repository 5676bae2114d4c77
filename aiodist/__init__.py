"""aiodist: the torch.distributed programming model on an event loop.

This module is the async face: every communication call starts its operation at once and
returns an awaitable ``Work``. ``aiodist.sync`` is the blocking, torch.distributed-compatible
face over the same runtime.
"""

from aiodist.errors import CollectiveMismatchError as CollectiveMismatchError
from aiodist.errors import DistError as DistError
from aiodist.errors import DistNetworkError as DistNetworkError
from aiodist.errors import DistStoreError as DistStoreError
from aiodist.errors import DistTimeoutError as DistTimeoutError
from aiodist.errors import DistTypeError as DistTypeError
from aiodist.errors import DistValueError as DistValueError
from aiodist.errors import GroupOutOfStepError as GroupOutOfStepError
from aiodist.face import tensor_collectives as _tensor_collectives
from aiodist.face.monitored_barrier import monitored_barrier as monitored_barrier
from aiodist.face.object_collectives import all_gather_object as all_gather_object
from aiodist.face.object_collectives import broadcast_object_list as broadcast_object_list
from aiodist.face.object_collectives import gather_object as gather_object
from aiodist.face.object_collectives import recv_object_list as recv_object_list
from aiodist.face.object_collectives import scatter_object_list as scatter_object_list
from aiodist.face.object_collectives import send_object_list as send_object_list
from aiodist.face.p2p import P2POp as P2POp
from aiodist.face.p2p import batch_isend_irecv as batch_isend_irecv
from aiodist.face.p2p import irecv as irecv
from aiodist.face.p2p import isend as isend
from aiodist.face.p2p import recv as recv
from aiodist.face.p2p import send as send
from aiodist.face.resync import resync as resync
from aiodist.face.tensor_collectives import *  # noqa: F403 (the tensor collectives, one per table entry)
from aiodist.face.world import WORLD as WORLD
from aiodist.face.world import destroy_process_group as destroy_process_group
from aiodist.face.world import get_backend as get_backend
from aiodist.face.world import get_rank as get_rank
from aiodist.face.world import get_world_size as get_world_size
from aiodist.face.world import init_process_group as init_process_group
from aiodist.face.world import is_initialized as is_initialized
from aiodist.face.world import new_group as new_group
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
    "GroupOutOfStepError",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "monitored_barrier",
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
    "resync",
    "send",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]
__all__ += _tensor_collectives.__all__
