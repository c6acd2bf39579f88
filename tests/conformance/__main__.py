"""``python -m tests.conformance``: run torch's RPC test suite against nbremote and report per file.

``--check`` (what CI runs) exits with 1 if a test fails that is not a known failure, or if the list of
tests that do not apply is wrong (a listed test passed, or failed for another reason).
"""

from __future__ import annotations

import argparse
import faulthandler
import fnmatch
import json
import signal
import sys
import time
from pathlib import Path

from tests.conformance import report, runner, verdicts

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"  # git-ignored, as the test suite's reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance", description=__doc__)
    parser.add_argument("--files", nargs="*", default=list(runner.FILES), help="which of torch's files")
    parser.add_argument("-k", "--only", default="*", help="glob over Class.test_method")
    parser.add_argument("--deadline", type=float, default=30.0, help="seconds a test may run on its ranks")
    parser.add_argument("--check", action="store_true", help="exit 1 on any failure but the known ones")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--log", default=str(ARTIFACTS / "conformance.log"), help="what the tests printed")
    parser.add_argument("--quiet", action="store_true", help="no line per test")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: where the runner is stuck
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)

    world = runner.World()
    results = []
    started = time.monotonic()
    with runner.quiet(args.log) as progress:
        world.start()
        try:
            tests = [t for t in runner.discover(args.files) if fnmatch.fnmatch(t.id, args.only)]
            for i, test in enumerate(tests):
                if test.id in verdicts.NOT_RUN:  # its outcome would be a matter of timing (see NOT_RUN)
                    result = runner.Result(test, "skip", 0.0, f"not run: {verdicts.NOT_RUN[test.id]}")
                else:
                    result = world.run(test, verdicts.DEADLINES.get(test.id, args.deadline))
                results.append(result)
                if not args.quiet:
                    print(f"[{i + 1}/{len(tests)}] {result.outcome:8} {result.seconds:5.1f}s {test.file} {test.id}"
                          f"  {' '.join(result.error.split())[:200]}", file=progress, flush=True)
                if result.overran:
                    world.restart()
        finally:
            world.stop()
    judged = report.judge_all(results)
    report.print_report(judged, sys.stdout, time.monotonic() - started)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(judged), indent=1))
    return 1 if args.check and any(j.verdict == "fail" for j in judged) else 0


if __name__ == "__main__":
    sys.exit(main())
