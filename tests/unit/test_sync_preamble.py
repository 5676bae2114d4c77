"""torch's preamble of the sync face (``aiodist.sync._preamble.torch_op``), without a job: a rank
outside the group skips the operation with torch's warning, pointing at the caller's line, and
returns what torch returns; a root given twice is refused before anything runs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import aiodist.sync as dist
from aiodist.errors import DistValueError

OUTSIDE = dist.GroupMember.NON_GROUP_MEMBER


@pytest.mark.parametrize(
    ("call", "skipped"),
    [
        (lambda t: dist.all_reduce(t, group=OUTSIDE), None),
        (lambda t: dist.broadcast(t, 0, group=OUTSIDE), None),
        (lambda t: dist.gather(t, None, group=OUTSIDE), None),
        (lambda t: dist.send(t, 1, group=OUTSIDE), None),
        (lambda t: dist.recv(t, 1, group=OUTSIDE), -1),
        (lambda t: dist.irecv(t, group=OUTSIDE), None),
        (lambda t: dist.barrier(group=OUTSIDE), None),
        (lambda t: dist.recv_object_list([None], group=OUTSIDE), -1),
    ],
)
def test_a_non_member_skips_with_torchs_warning_at_the_callers_line(call: object, skipped: object) -> None:
    t = np.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert call(t) == skipped  # type: ignore[operator]
    assert len(caught) == 1
    assert "which does not belong to the given group" in str(caught[0].message)
    assert caught[0].filename == __file__  # stacklevel: the user's call, not the decorator
    assert t.tolist() == [1.0] * 3


@pytest.mark.parametrize(
    "call",
    [
        lambda t: dist.broadcast(t, 0, group_src=0),
        lambda t: dist.reduce(t, dst=1, group_dst=0),
        lambda t: dist.send(t, 1, group_dst=0),
        lambda t: dist.recv(t, src=1, group_src=0),
    ],
)
def test_a_root_given_both_ways_is_refused(call: object) -> None:
    with pytest.raises(DistValueError, match="Can only specify one of"):
        call(np.ones(2))  # type: ignore[operator]


def test_a_required_root_left_out_is_refused() -> None:
    with pytest.raises(DistValueError, match="Must specify either dst or group_dst"):
        dist.send(np.ones(2))
