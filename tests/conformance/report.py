"""What a run found, per file: pass, fail, not applicable (with the reason for every one), known failures.

The pass rate is of the tests that apply: ``pass / (pass + fail + known)``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from tests.conformance import verdicts
from tests.conformance.runner import FILES, Result

__all__ = ["Judged", "judge_all", "print_report", "to_json"]


@dataclass(frozen=True)
class Judged:
    result: Result
    verdict: str  # "pass", "fail", "n/a", "known"
    why: str  # the reason (n/a), the explanation (known), the error (fail)


def judge_all(results: Iterable[Result]) -> list[Judged]:
    judged = []
    for r in results:
        text = f"{r.error}\n{r.tb}" if r.tb else r.error
        verdict, why = verdicts.judge(r.test.id, r.outcome, text)
        judged.append(Judged(r, verdict, why))
    return judged


def totals(judged: Iterable[Judged]) -> dict[str, collections.Counter[str]]:
    per_file: dict[str, collections.Counter[str]] = {file: collections.Counter() for file in FILES}
    for j in judged:
        per_file[j.result.test.file][j.verdict] += 1
    return {file: count for file, count in per_file.items() if count}


def _rate(count: collections.Counter[str]) -> str:
    applicable = count["pass"] + count["fail"] + count["known"]
    return f"{100 * count['pass'] / applicable:5.1f} %" if applicable else "    -"


def print_report(judged: list[Judged], out: TextIO, seconds: float) -> None:
    per_file = totals(judged)
    out.write(f"\ntorch's RPC test suite against nbremote: {len(judged)} tests in {seconds:.0f} s\n")
    out.write(f"{'file':45} {'tests':>5} {'pass':>5} {'fail':>5} {'known':>5} {'n/a':>5}  pass rate (applicable)\n")
    grand: collections.Counter[str] = collections.Counter()
    for file, count in per_file.items():
        grand.update(count)
        out.write(f"{file:45} {sum(count.values()):5} {count['pass']:5} {count['fail']:5} {count['known']:5} "
                  f"{count['n/a']:5}  {_rate(count)}\n")
    out.write(f"{'total':45} {sum(grand.values()):5} {grand['pass']:5} {grand['fail']:5} {grand['known']:5} "
              f"{grand['n/a']:5}  {_rate(grand)}\n")

    by_reason: dict[str, list[Judged]] = collections.defaultdict(list)
    for j in judged:
        if j.verdict == "n/a":
            by_reason[j.why].append(j)
    out.write("\nnot applicable, by reason (each checked against what the test raised):\n")
    for reason, items in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        out.write(f"  {len(items):3} {reason}: {verdicts.REASONS[reason]}\n")
        for file in FILES:
            ids = [j.result.test.id for j in items if j.result.test.file == file]
            if ids:
                out.write(f"        {file}: {', '.join(ids)}\n")
    for verdict, title in (("known", "known failures (they apply; why they fail)"), ("fail", "failures")):
        items = [j for j in judged if j.verdict == verdict]
        if items:
            out.write(f"\n{title}:\n")
            for j in items:
                out.write(f"  {j.result.test.file} {j.result.test.id} ({j.result.seconds:.1f} s): {j.why}\n")


def to_json(judged: list[Judged]) -> list[dict[str, Any]]:
    return [{"file": j.result.test.file, "test": j.result.test.id, "verdict": j.verdict, "why": j.why,
             "outcome": j.result.outcome, "seconds": round(j.result.seconds, 2), "error": j.result.error,
             "rank": j.result.rank, "tb": j.result.tb, "ranks": j.result.ranks} for j in judged]
