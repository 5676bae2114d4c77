"""Reading a failed worker's stderr: its error line, the ranks it blames, its traceback without noise.

Pure functions over lines of text. A Python traceback from the sync facade runs through 10-15
frames of aiodist itself, ``asyncio`` and ``concurrent.futures`` between the user's call and the
exception; quoted whole, they push the user's own line out of a short tail. :func:`compress_frames`
folds each run of such frames into one line, ``(N aiodist/asyncio frames hidden)``; the worker's
full stderr stays in its log file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["blamed_rank", "compress_frames", "error_line", "named_ranks"]

_FRAME = re.compile(r'^(?P<indent>\s*)File "(?P<path>[^"]+)", line \d+')
_TRACEBACK = "Traceback (most recent call last):"
# Stack frames in these places are the machinery between the user's call and the error.
_AIODIST_DIR = str(Path(__file__).resolve().parents[1]) + "/"
_INTERNAL_PARTS = ("/site-packages/aiodist/", "/asyncio/", "/concurrent/futures/")
# "rank 3", "ranks 1, 2 and 5", "Rank 1 failed to pass monitoredBarrier".
_RANKS = re.compile(r"\branks?\s+(\d+(?:\s*(?:,|and|or)\s*\d+)*)", re.IGNORECASE)
# How aiodist reports two ranks whose operations disagree (a CollectiveMismatchError).
_DISAGREEMENT = re.compile(r"\brank (\d+) expected .+? but rank (\d+) sent ")


def _internal(path: str) -> bool:
    return path.startswith(_AIODIST_DIR) or any(part in path for part in _INTERNAL_PARTS)


def compress_frames(lines: Sequence[str]) -> tuple[list[str], int]:
    """``lines`` with each run of internal traceback frames replaced by one line saying how many.

    A frame is its ``File "...", line N, in f`` line and the more indented lines under it (the
    source line and its ``^^^`` markers). Internal frames are those of the aiodist package,
    ``asyncio`` and ``concurrent.futures``.

    Returns:
        ``(lines, hidden)``: the compressed lines and how many frames were hidden in all.
    """
    out: list[str] = []
    run = 0  # internal frames seen since the last line kept
    total = 0
    indent = ""

    def close_run() -> None:
        nonlocal run
        if run:
            out.append(f"{indent}({run} aiodist/asyncio frame{'s' if run > 1 else ''} hidden)")
            run = 0

    i = 0
    while i < len(lines):
        match = _FRAME.match(lines[i])
        if match is None:
            close_run()
            out.append(lines[i])
            i += 1
            continue
        end = i + 1
        body_indent = match.group("indent") + " "
        while end < len(lines) and lines[end].startswith(body_indent) and not _FRAME.match(lines[end]):
            end += 1
        if _internal(match.group("path")):
            indent = match.group("indent")
            run += 1
            total += 1
        else:
            close_run()
            out.extend(lines[i:end])
        i = end
    close_run()
    return out, total


def error_line(lines: Sequence[str]) -> str | None:
    """The one line that says what went wrong: the exception line of the last traceback.

    That is the first unindented line after the last ``Traceback (most recent call last):``
    (the frames are indented). Without a traceback, the last non-empty line; None when empty.
    """
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK]
    if starts:
        for line in lines[starts[-1] + 1 :]:
            if line.strip() and not line[:1].isspace():
                return line.strip()
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return None


def named_ranks(text: str, *, own_rank: int) -> list[int]:
    """The ranks other than ``own_rank`` that ``text`` names, in the order it first names them.

    aiodist's errors about a failure elsewhere name the rank they report first, then give that
    rank's own account: "rank 2 abandoned all_reduce #1: rank 1 closed its connection" names
    rank 2, then the rank whose loss made rank 2 give up.
    """
    ranks: list[int] = []
    for group in _RANKS.findall(text):
        for number in map(int, re.findall(r"\d+", group)):
            if number != own_rank and number not in ranks:
                ranks.append(number)
    return ranks


def blamed_rank(text: str, *, own_rank: int) -> int | None:
    """The first rank other than ``own_rank`` that ``text`` names ("rank 2", "ranks 1 and 3"), or None.

    aiodist's errors about a failure elsewhere name the rank they report first: "rank 2
    abandoned all_reduce #1: ...", "rank 1 closed its connection", "rank 0 expected all_reduce
    (float32 x 10) but rank 1 sent ...".
    """
    ranks = named_ranks(text, own_rank=own_rank)
    return ranks[0] if ranks else None


def disagreement(text: str) -> tuple[int, int] | None:
    """The two ranks of the first disagreement ``text`` reports, or None.

    "rank 1 expected all_reduce #1 (float32 x 20, sum) but rank 0 sent all_reduce #1 (...)"
    gives ``(1, 0)``, also inside another rank's account ("rank 2 abandoned all_reduce #1: ...").
    """
    found = _DISAGREEMENT.search(text)
    return (int(found.group(1)), int(found.group(2))) if found else None
