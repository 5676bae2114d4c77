"""``python -m aiodist.torch --build``: compile the torch backend's C++ extension ahead of time.

The first process group on "aiodist" compiles it otherwise (30 s to 2 minutes, once per torch
version); running this once per machine, image or CI cache makes that first group load it in
about a second instead.
"""

from __future__ import annotations

import argparse
import sys
import time

from aiodist.torch._build import ExtensionBuildError, cache_dir, load_extension


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiodist.torch",
        description="The C++ extension of aiodist's torch backend ('aiodist'), compiled against the "
        "installed torch and cached (AIODIST_CACHE_DIR, else $XDG_CACHE_HOME/aiodist or ~/.cache/aiodist).",
    )
    parser.add_argument(
        "--build",
        action="store_true",
        help="compile the extension now (or load it from the cache) and say where it is",
    )
    parser.add_argument("--where", action="store_true", help="print the extension's cache directory")
    args = parser.parse_args(argv)
    if args.where:
        print(cache_dir())
    if not args.build:
        if not args.where:
            parser.print_help()
        return 0
    t0 = time.perf_counter()
    try:
        load_extension()
    except ExtensionBuildError as exc:
        print(f"aiodist: {exc}", file=sys.stderr)
        return 1
    print(
        f"aiodist: the torch backend's extension is ready in {cache_dir()} ({time.perf_counter() - t0:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
