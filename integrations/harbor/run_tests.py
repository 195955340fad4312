"""Runs this directory's unit tests and writes what happened to a JSON file, for callers that must not parse
unittest's text output (tests/harbor.test.ts): under load, asyncio's debug-mode warnings and the tests' own log
lines land on the same stderr.

    python3 run_tests.py --result FILE [--pattern 'test_*.py'] [-v]

FILE gets {"ran": N, "passed": [...], "failures": [...], "errors": [...], "skipped": {"test id": "reason"},
"ok": bool}; the exit code is 0 exactly when "ok" is true and at least one test ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent


class RecordingResult(unittest.TextTestResult):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.passed: list[str] = []

    def addSuccess(self, test) -> None:  # noqa: N802 - unittest's name
        super().addSuccess(test)
        self.passed.append(test.id())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--pattern", default="test_*.py")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    suite = unittest.defaultTestLoader.discover(str(HERE), pattern=args.pattern, top_level_dir=str(HERE))
    runner = unittest.TextTestRunner(verbosity=2 if args.verbose else 1, resultclass=RecordingResult)
    result = runner.run(suite)
    report = {
        "ran": result.testsRun,
        "passed": result.passed,
        "failures": [test.id() + "\n" + trace for test, trace in result.failures],
        "errors": [getattr(test, "id", lambda: str(test))() + "\n" + trace for test, trace in result.errors],
        "unexpected_successes": [test.id() for test in result.unexpectedSuccesses],
        "skipped": {test.id(): reason for test, reason in result.skipped},
        "ok": result.wasSuccessful(),
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] and report["ran"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
