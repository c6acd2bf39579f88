"""torch's own RPC test suite against nbremote, the whole of it (``tests/conformance``; issue 21).

Runs as its own driver process, with a world of its own (worker0 + three kernels), so that torch's
module names can point at nbremote's there without touching this session. It fails on any test that
fails but the known failures, and on a not-applicable list that is wrong (a listed test passed, or
failed for another reason than the one listed). Its totals go in the terminal summary; the full
report and every result are kept in ``tests/artifacts/``. 3-3.5 min here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ARTIFACTS, ROOT, report

pytestmark = pytest.mark.timeout(1200)


def test_torch_rpc_suite_passes_every_test_that_applies() -> None:
    pytest.importorskip("expecttest", reason="torch's test modules need expecttest (in the test extra)")
    ARTIFACTS.mkdir(exist_ok=True)
    results = ARTIFACTS / "conformance.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.conformance", "--check", "--quiet", "--json", str(results),
         "--log", str(ARTIFACTS / "conformance.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=1100)
    (ARTIFACTS / "conformance.txt").write_text(run.stdout + run.stderr)
    totals = run.stdout.split("not applicable, by reason")[0].strip().splitlines()
    for line in totals:
        report("torch's RPC test suite (tests/conformance)", line)
    report("torch's RPC test suite (tests/conformance)", f"the full report: {ARTIFACTS / 'conformance.txt'}")
    failed = [r for r in json.loads(results.read_text()) if r["verdict"] == "fail"] if results.exists() else []
    assert run.returncode == 0, "\n".join(
        [f"{r['file']} {r['test']}: {r['why']}" for r in failed] or [run.stdout[-3000:], run.stderr[-3000:]])
