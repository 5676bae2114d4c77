"""``monitored_barrier`` of the blocking face: the async face's, with torch's signature and wording."""

from __future__ import annotations

from typing import Any

from aiodist.face.monitored_barrier import monitored_barrier
from aiodist.sync._bridge import call
from aiodist.sync._core import not_in_group


def sync_monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """The blocking face's ``monitored_barrier``: torch.distributed's signature and wording.

    On a rank outside ``group`` (``new_group`` gave it ``GroupMember.NON_GROUP_MEMBER``) it is
    skipped with torch's warning, as every operation of that face.
    """
    if not_in_group(group, "monitored_barrier"):
        return
    call(lambda: monitored_barrier(group, timeout, wait_all_ranks, torch_wording=True), False)
