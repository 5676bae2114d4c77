"""atheris target: the sans-IO frame reader (aiodist.wire.frames.FrameReader).

Any byte stream, cut into pieces at fuzzer-chosen offsets, must either yield frames or raise
``ProtocolError``: no other exception, and no payload buffer larger than the limits allow.
Run: ``python fuzz/fuzz_frames.py -max_total_time=600`` (see fuzz/README.md).
"""

from __future__ import annotations

import sys
from typing import Any

import atheris

with atheris.instrument_imports():
    from aiodist.wire.frames import FrameReader, Limits, ProtocolError

LIMITS = Limits(max_header=1024, max_payload=1 << 16, max_str=256, max_bin=256, max_array=64, max_map=16)


def test_one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    into_sink = fdp.ConsumeBool()
    scratch = fdp.ConsumeIntInRange(16, 4096)
    cuts = [fdp.ConsumeIntInRange(1, 512) for _ in range(fdp.ConsumeIntInRange(1, 8))]
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())

    def on_header(header: Any, n: int) -> memoryview | None:
        if n > LIMITS.max_payload:
            raise AssertionError(f"a payload of {n} bytes got past the limit")
        return memoryview(bytearray(n)) if into_sink else None

    reader = FrameReader(on_header, lambda h, p: None, LIMITS, scratch_size=scratch)
    pos, i = 0, 0
    try:
        while pos < len(stream):
            n = cuts[i % len(cuts)]
            reader.feed(stream[pos : pos + n])
            pos += n
            i += 1
    except ProtocolError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
