# The compiled twin of aiodist.transport.shm_eager.take_eager (_shm_eager.pyx): its interface.
from typing import Any

from aiodist.transport.matching import Matcher
from aiodist.transport.shm_segment import Rings
from aiodist.wire.fingerprint import Fingerprint
from aiodist.wire.messages import Key
from aiodist.wire.shm import ShapeReader, ShapeWriter

def runs_on(ring: Any, mailbox: Any) -> bool: ...
def take_eager(ring: Rings, shapes: ShapeReader, mailbox: Matcher, peer: int) -> tuple[int, int]: ...
def writes(ring: Any) -> bool: ...
def write_eager(
    ring: Rings, shapes: ShapeWriter, key: Key, fp: Fingerprint | None, payload: memoryview
) -> int: ...
