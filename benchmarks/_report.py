"""The table and the JSON: figures per case and system, paired ratios, checks and verdicts.

Every ratio is a paired ratio of *times* (``_stats.paired_ratio``), the row's system over the column's
reference, so below 1.0 means the row's system is faster. Throughput is shown in calls/s, but its ratio is
still of burst times: 0.5 means twice torch's calls/s. The floor is raw zmq for calls and echoes, and the
local computation for the RemoteModule forward and the training step.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _cases import LOCAL, NBREMOTE, PS_STEPS, SYSTEM_ORDER, TORCH, TORCH_UV, ZMQ, Case
from _stats import Outcome, Verdict, paired_ratio, percentile, summary

Results = Mapping[str, Mapping[str, Outcome]]
HEADER = ("case", "system", "median", "p90", "n", "÷floor", "÷torch", "÷torch-uv", "nbremote target", "notes")
LOSS_TOLERANCE = 1e-5  # every system's first training loss, from the same weights and data


def floor_of(case: Case) -> str | None:
    return {"call": ZMQ, "echo": ZMQ, "module": LOCAL, "train": LOCAL, "fused": LOCAL, "train4": LOCAL, "pipe4": LOCAL,
            "pipe4rref": LOCAL, "ps": LOCAL}.get(case.kind)


def fmt_value(case: Case, seconds: float) -> str:
    if case.kind == "burst":
        return f"{case.inflight / seconds:,.0f} /s"
    if case.kind == "ps":  # two trainers' steps
        return f"{2 * PS_STEPS / seconds:,.0f} steps/s"
    if case.kind == "start":
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms"


def _ratio(outcomes: Mapping[str, Outcome], system: str, against: str | None) -> str:
    if against is None or against == system or against not in outcomes or system not in outcomes:
        return ""
    ratio = paired_ratio(outcomes[system].rounds, outcomes[against].rounds)
    return "" if ratio is None else f"{ratio:.2f}x"


def check_problems(case: Case, outcomes: Mapping[str, Outcome]) -> dict[str, str]:
    """What the checks found wrong, by system: a mangled echo, a different output, a different loss."""
    problems = {}
    for name, outcome in outcomes.items():
        if outcome.info.get("bit_exact") is False:
            problems[name] = "echo NOT bit-exact"
        if outcome.info.get("same_as_local") is False:
            problems[name] = "output differs from the local module's"
    losses = {n: o.info["first_loss"] for n, o in outcomes.items() if "first_loss" in o.info}
    if losses and max(losses.values()) - min(losses.values()) > LOSS_TOLERANCE:
        for name in losses:
            problems[name] = f"first losses differ: {losses}"
    return problems


def _notes(case: Case, outcome: Outcome, problem: str | None) -> str:
    notes = []
    if outcome.skipped:
        notes.append(f"skipped: {outcome.skipped}")
    if outcome.error:
        notes.append(f"ERROR {outcome.error}")
    if problem:
        notes.append(problem)
    elif outcome.info.get("bit_exact"):
        notes.append("bit-exact")
    if "first_loss" in outcome.info:
        notes.append(f"first loss {outcome.info['first_loss']:.6f}")
    for name, values in outcome.extra.items():
        notes.append(f"{name} {statistics.median(values):.2f} s")
    return "; ".join(notes)


def rows(cases: Sequence[Case], results: Results, verdicts: Sequence[Verdict]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for case in cases:
        outcomes = results.get(case.id, {})
        problems = check_problems(case, outcomes)
        first = True
        for name in sorted(outcomes, key=lambda n: SYSTEM_ORDER.index(n) if n in SYSTEM_ORDER else 99):
            outcome = outcomes[name]
            samples = outcome.samples
            median = fmt_value(case, statistics.median(samples)) if samples else "-"
            p90 = fmt_value(case, percentile(samples, 90)) if samples and case.per_call else ""
            target = ""
            if name == NBREMOTE:
                target = "; ".join(f"{v.text()}" + ("" if v.ratio is None else f" ({v.ratio:.2f}x)")
                                   for v in verdicts if v.case == case.id)
            out.append((case.label if first else "", name, median, p90, str(len(samples)) if samples else "",
                        _ratio(outcomes, name, floor_of(case)), _ratio(outcomes, name, TORCH),
                        _ratio(outcomes, name, TORCH_UV), target, _notes(case, outcome, problems.get(name))))
            first = False
    return out


def table(cases: Sequence[Case], results: Results, verdicts: Sequence[Verdict]) -> str:
    body = rows(cases, results, verdicts)
    widths = [max(len(r[i]) for r in (HEADER, *body)) for i in range(len(HEADER))]
    lines = []
    for i, row in enumerate((HEADER, *body)):
        if i > 0 and row[0]:
            lines.append("-+-".join("-" * w for w in widths))
        lines.append(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def to_json(cases: Sequence[Case], results: Results, verdicts: Sequence[Verdict],
            meta: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(meta)
    out["cases"] = [{"id": c.id, "group": c.group, "label": c.label, "kind": c.kind, "rounds": c.rounds,
                     "block": c.block, "warmup": c.warmup, "workers": c.workers, "nbytes": c.nbytes,
                     "payload": c.payload, "inflight": c.inflight, "floor": floor_of(c),
                     "targets": [{"against": t.against, "limit": t.limit, "text": t.text} for t in c.targets]}
                    for c in cases]
    out["results"] = {c.id: {name: _outcome_json(c, o, results[c.id]) for name, o in results.get(c.id, {}).items()}
                      for c in cases if c.id in results}
    out["verdicts"] = [{"case": v.case, "target": v.target, "ratio": v.ratio, "met": v.met} for v in verdicts]
    return out


def _outcome_json(case: Case, outcome: Outcome, outcomes: Mapping[str, Outcome]) -> dict[str, Any]:
    ratios = {}
    for key, against in (("floor", floor_of(case)), ("torch", TORCH), ("torch-uv", TORCH_UV)):
        if against and against != outcome.system and against in outcomes:
            ratios[key] = paired_ratio(outcome.rounds, outcomes[against].rounds)
    samples = outcome.samples
    rate = {}
    if case.kind == "burst" and samples:
        rate["calls_per_s_median"] = case.inflight / statistics.median(samples)
    return {"status": outcome.status, "error": outcome.error, "skipped": outcome.skipped, "info": outcome.info,
            "prepare_s": outcome.prepare_s, "summary": {**summary(samples), **rate}, "ratios": ratios,
            "round_medians": [statistics.median(r) for r in outcome.rounds if r],
            "extra": {k: summary(v) for k, v in outcome.extra.items()}, "rounds": outcome.rounds}


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")



def failures(cases: Sequence[Case], results: Results) -> list[str]:
    """Every error and failed check, as ``case / system: what``; skipped systems are not failures."""
    found = []
    for case in cases:
        outcomes = results.get(case.id, {})
        problems = check_problems(case, outcomes)
        for name, outcome in outcomes.items():
            for what in (outcome.error, problems.get(name)):
                if what:
                    found.append(f"{case.id} / {name}: {what}")
    return found


LEGEND = """\
median, p90: over every sample of every round (p90 only where a sample is one call among many); n samples.
÷floor, ÷torch, ÷torch-uv: the row's time over the reference's, paired by round (median over rounds of the
ratio of round medians), so <1.0 = the row is faster; it can differ from the ratio of the two medians shown
when the load changed during the run (the JSON keeps every round's median). floor = raw zmq (calls,
echoes) or local (module, training). Throughput is in calls/s, but its ratios are of burst times: 0.50x =
twice the reference's calls/s. torch = torch.distributed.rpc, TensorPipe default (shared memory on one
host); torch-uv = TCP (uv) only. World start, until a call to each worker returned: nbremote's init_rpc
(it starts the kernels); torch's processes spawned, torch imported in each, init_rpc (torch's init_rpc
alone in the notes). nbremote's kernels import torch only when a call first needs it."""
