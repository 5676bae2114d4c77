"""Sans-IO wire protocol: frames, handshake, the messages as data (messages, control, detail,
store). No asyncio, no sockets here."""

from aiodist.wire.frames import (
    DEFAULT_LIMITS as DEFAULT_LIMITS,
)
from aiodist.wire.frames import (
    FrameReader as FrameReader,
)
from aiodist.wire.frames import (
    Limits as Limits,
)
from aiodist.wire.frames import (
    ProtocolError as ProtocolError,
)
from aiodist.wire.frames import (
    encode_frame as encode_frame,
)

__all__ = ["DEFAULT_LIMITS", "FrameReader", "Limits", "ProtocolError", "encode_frame"]
