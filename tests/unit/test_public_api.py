"""The public surface is curated: SPEC's names in both faces, nothing else by accident."""

from __future__ import annotations

import aiodist
import aiodist.sync

# SPEC §2 / §3: every name a user (or an outside suite) may rely on, in both faces.
SPEC_NAMES = {
    "init_process_group", "destroy_process_group", "new_group", "get_rank", "get_world_size",
    "is_initialized", "get_backend",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp",
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
    "ReduceOp", "reduce_op", "Work",
    "TCPStore", "FileStore", "HashStore", "PrefixStore",
    "DistError", "DistTimeoutError", "DistNetworkError", "DistStoreError", "CollectiveMismatchError",
}  # fmt: skip

# The async face's whole surface, pinned: adding a name is a decision, not an accident.
ASYNC_EXTRAS = {
    "DistTypeError", "DistValueError", "ProcessGroup", "Store", "WORLD",
    "GroupOutOfStepError", "resync",  # recovery after a timeout (README "After a failure")
}  # fmt: skip


def test_async_face_is_exactly_the_pinned_surface() -> None:
    assert set(aiodist.__all__) == SPEC_NAMES | ASYNC_EXTRAS
    for name in aiodist.__all__:
        assert getattr(aiodist, name) is not None


def test_sync_face_has_every_spec_name() -> None:
    missing = (SPEC_NAMES | {"GroupOutOfStepError", "resync"}) - set(aiodist.sync.__all__)
    assert not missing
    for name in aiodist.sync.__all__:
        assert hasattr(aiodist.sync, name), name
    assert not [n for n in aiodist.sync.__all__ if n.startswith("_")]


def test_error_family() -> None:
    for name in ("DistTimeoutError", "DistNetworkError", "DistStoreError", "CollectiveMismatchError"):
        assert issubclass(getattr(aiodist, name), aiodist.DistError)
    assert issubclass(aiodist.DistError, RuntimeError)
    assert issubclass(aiodist.DistTimeoutError, TimeoutError)
    assert issubclass(aiodist.DistValueError, ValueError) and issubclass(aiodist.DistTypeError, TypeError)
    assert aiodist.reduce_op is aiodist.ReduceOp
    ops = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"}
    assert ops <= {op.name for op in aiodist.ReduceOp}
