"""Run some tests of torch's distributed suite in this process (no pytest); write JSON results.

    python tests/torch_suite/driver.py OUT.json test_a test_b ...

The environment picks the variant, world size and per-test timeout (see suite.py and run.py).
Each result is ``{"name", "status": passed|failed|skipped, "reason", "seconds"}``; the reason is
one line: the last line of the failing rank's traceback (or the timeout).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import unittest
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import suite


def one_line(text: str) -> str:
    """The line of a failure text that says what went wrong (the rank's exception, or the timeout)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "failed without a message"
    for ln in lines:
        if "timed out after" in ln.lower():
            return ln[:300]
    # MultiProcessTestCase reports "Process N exited with error code 10 and exception:" followed
    # by the rank's traceback, whose last exception line is the cause.
    exceptions = [
        ln for ln in lines if EXCEPTION_LINE.match(ln) and not ln.startswith("RuntimeError: Process ")
    ]
    return (exceptions[-1] if exceptions else lines[-1])[:300]


EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\w*(:|$)")


class Recorder(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self._t0 = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._t0 = time.monotonic()
        print(f"  {test.id().rsplit('.', 1)[-1]} ...", end="", flush=True)

    def _row(self, test: unittest.TestCase, status: str, reason: str) -> None:
        name = test.id().rsplit(".", 1)[-1]
        secs = round(time.monotonic() - self._t0, 2)
        self.rows.append({"name": name, "status": status, "reason": reason, "seconds": secs})
        print(f" {status} ({secs} s){': ' + reason if reason and status == 'failed' else ''}", flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._row(test, "passed", "")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._row(test, "failed", one_line(self.failures[-1][1]))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._row(test, "failed", one_line(self.errors[-1][1]))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._row(test, "skipped", reason)


def main(argv: list[str]) -> int:
    out, names = argv[0], argv[1:]
    tests = unittest.TestSuite(suite.TestDistBackendWithSpawn(name) for name in names)
    result = Recorder()
    try:
        tests.run(result)  # runs the class's setUpClass/tearDownClass too
    finally:
        with open(out, "w") as f:
            json.dump(result.rows, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
