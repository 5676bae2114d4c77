"""The blocking face: a drop-in for ``torch.distributed`` (``import aiodist.sync as dist``).

Every call has torch.distributed's signature; operations block unless ``async_op=True``,
which returns a ``Work``. The runtime runs on a background uvloop thread.
"""

from aiodist.errors import CollectiveMismatchError as CollectiveMismatchError
from aiodist.errors import DistError as DistError
from aiodist.errors import DistNetworkError as DistNetworkError
from aiodist.errors import DistStoreError as DistStoreError
from aiodist.errors import DistTimeoutError as DistTimeoutError
from aiodist.errors import GroupOutOfStepError as GroupOutOfStepError
from aiodist.group import ProcessGroup as ProcessGroup
from aiodist.ops import ReduceOp as ReduceOp
from aiodist.ops import reduce_op as reduce_op
from aiodist.store.blocking import BlockingStore as Store
from aiodist.store.blocking import FileStore as FileStore
from aiodist.store.blocking import HashStore as HashStore
from aiodist.store.blocking import PrefixStore as PrefixStore
from aiodist.store.blocking import TCPStore as TCPStore
from aiodist.sync import _collectives
from aiodist.sync._coalesced import all_gather_coalesced as all_gather_coalesced
from aiodist.sync._coalesced import all_reduce_coalesced as all_reduce_coalesced
from aiodist.sync._collectives import *  # noqa: F403 (the collectives: tensor ones, one per table entry, and objects)
from aiodist.sync._collectives import _all_gather_base as _all_gather_base
from aiodist.sync._collectives import _reduce_scatter_base as _reduce_scatter_base
from aiodist.sync._core import Backend as Backend
from aiodist.sync._core import DistBackendError as DistBackendError
from aiodist.sync._core import GroupMember as GroupMember
from aiodist.sync._core import P2POp as P2POp
from aiodist.sync._core import batch_isend_irecv as batch_isend_irecv
from aiodist.sync._core import default_pg_timeout as default_pg_timeout
from aiodist.sync._core import destroy_process_group as destroy_process_group
from aiodist.sync._core import get_backend as get_backend
from aiodist.sync._core import get_default_backend_for_device as get_default_backend_for_device
from aiodist.sync._core import get_global_rank as get_global_rank
from aiodist.sync._core import get_group_rank as get_group_rank
from aiodist.sync._core import get_node_local_rank as get_node_local_rank
from aiodist.sync._core import get_pg_count as get_pg_count
from aiodist.sync._core import get_process_group_ranks as get_process_group_ranks
from aiodist.sync._core import get_rank as get_rank
from aiodist.sync._core import get_world_size as get_world_size
from aiodist.sync._core import group as group
from aiodist.sync._core import init_process_group as init_process_group
from aiodist.sync._core import irecv as irecv
from aiodist.sync._core import is_available as is_available
from aiodist.sync._core import is_backend_available as is_backend_available
from aiodist.sync._core import is_gloo_available as is_gloo_available
from aiodist.sync._core import is_initialized as is_initialized
from aiodist.sync._core import is_mpi_available as is_mpi_available
from aiodist.sync._core import is_nccl_available as is_nccl_available
from aiodist.sync._core import is_torchelastic_launched as is_torchelastic_launched
from aiodist.sync._core import is_ucc_available as is_ucc_available
from aiodist.sync._core import is_xccl_available as is_xccl_available
from aiodist.sync._core import isend as isend
from aiodist.sync._core import new_group as new_group
from aiodist.sync._core import new_subgroups as new_subgroups
from aiodist.sync._core import new_subgroups_by_enumeration as new_subgroups_by_enumeration
from aiodist.sync._core import recv as recv
from aiodist.sync._core import resync as resync
from aiodist.sync._core import send as send
from aiodist.sync._core import supports_complex as supports_complex
from aiodist.sync._debug import DebugLevel as DebugLevel
from aiodist.sync._debug import get_debug_level as get_debug_level
from aiodist.sync._debug import set_debug_level as set_debug_level
from aiodist.sync._debug import set_debug_level_from_env as set_debug_level_from_env
from aiodist.sync._monitored_barrier import sync_monitored_barrier as monitored_barrier
from aiodist.work import Work as Work

# As torch does when torch.distributed is imported: TORCH_DISTRIBUTED_DEBUG (else AIODIST_DEBUG).
set_debug_level_from_env()

__all__ = [
    "CollectiveMismatchError",
    "Backend",
    "DebugLevel",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
    "DistBackendError",
    "default_pg_timeout",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "is_backend_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "supports_complex",
    "Store",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "GroupOutOfStepError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "TCPStore",
    "Work",
    "monitored_barrier",
    "batch_isend_irecv",
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "resync",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce_op",
    "send",
]
__all__ += _collectives.__all__
