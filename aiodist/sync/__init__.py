"""The blocking face: a drop-in for ``torch.distributed`` (``import aiodist.sync as dist``).

Every call has torch.distributed's signature; operations block unless ``async_op=True``,
which returns a ``Work``. The runtime runs on a background uvloop thread.
"""

from aiodist.errors import CollectiveMismatchError as CollectiveMismatchError
from aiodist.errors import DistError as DistError
from aiodist.errors import DistNetworkError as DistNetworkError
from aiodist.errors import DistStoreError as DistStoreError
from aiodist.errors import DistTimeoutError as DistTimeoutError
from aiodist.group import ProcessGroup as ProcessGroup
from aiodist.ops import ReduceOp as ReduceOp
from aiodist.ops import reduce_op as reduce_op
from aiodist.store.blocking import FileStore as FileStore
from aiodist.store.blocking import HashStore as HashStore
from aiodist.store.blocking import PrefixStore as PrefixStore
from aiodist.store.blocking import TCPStore as TCPStore
from aiodist.sync._core import GroupMember as GroupMember
from aiodist.sync._core import P2POp as P2POp
from aiodist.sync._core import barrier as barrier
from aiodist.sync._core import batch_isend_irecv as batch_isend_irecv
from aiodist.sync._core import destroy_process_group as destroy_process_group
from aiodist.sync._core import get_backend as get_backend
from aiodist.sync._core import get_rank as get_rank
from aiodist.sync._core import get_world_size as get_world_size
from aiodist.sync._core import group as group
from aiodist.sync._core import init_process_group as init_process_group
from aiodist.sync._core import irecv as irecv
from aiodist.sync._core import is_available as is_available
from aiodist.sync._core import is_initialized as is_initialized
from aiodist.sync._core import isend as isend
from aiodist.sync._core import new_group as new_group
from aiodist.sync._core import recv as recv
from aiodist.sync._core import send as send
from aiodist.work import Work as Work

__all__ = [
    "CollectiveMismatchError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "TCPStore",
    "Work",
    "barrier",
    "batch_isend_irecv",
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce_op",
    "send",
]
