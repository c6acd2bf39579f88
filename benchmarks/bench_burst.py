"""The burst round of issue 38, many times over: what gets lost, wrong or off the Unix-domain link.

``python benchmarks/bench_burst.py [--rounds 20] [--calls 10000] [--zmq]``

Each round (``tests/burst.py``, the round ``tests/test_burst.py`` runs once in CI) issues ``--calls`` echo calls
at once, from the driver to 3 local workers and from each worker to the next, 1 B to 800 KB and 1 in 100 of
1-8 MB, with every core hogged; then waits for them all. Prints each round's counts and the totals: calls, ok,
wrong, lost, served twice, never served, fall-backs to zmq logged -- all but ``ok`` must be 0 -- and the
time per round beside the same round with ``NBREMOTE_UNIX=0`` (every link on zmq) when ``--zmq`` is given,
measured in the same run. Exit status 1 if any count that must be 0 is not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the round, importable by the workers

from burst import one_round

from nbremote import rpc
from nbremote.rpc._core import current_agent

WORKERS = ["w1", "w2", "w3"]
MUST_BE_ZERO = ("wrong", "lost", "twice", "never", "fallbacks")


def rounds(label: str, n: int, calls: int) -> tuple[dict[str, int], list[float]]:
    rpc.init_rpc("driver", workers=WORKERS)
    try:
        peers = current_agent().peers
        logs = {w: str(peers[w].log_path) for w in WORKERS}
        totals = dict.fromkeys(("calls", "ok", *MUST_BE_ZERO), 0)
        seconds = []
        for i in range(n):
            counts = one_round(WORKERS, logs, calls, seed=1000 + i)
            for k in totals:
                totals[k] += counts[k]
            seconds.append(counts["seconds"])
            print(f"{label} round {i + 1:2d}: {counts['calls']} calls, {counts['mb']:.0f} MB in "
                  f"{counts['seconds']:.1f} s: "
                  + ", ".join(f"{k} {counts[k]}" for k in ("ok", *MUST_BE_ZERO))
                  + (f"  e.g. {counts['examples'][0]}" if counts["examples"] else ""), flush=True)
        return totals, seconds
    finally:
        rpc.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--zmq", action="store_true", help="also run the rounds with every link on zmq, to compare")
    args = parser.parse_args()
    results = {"unix": rounds("unix", args.rounds, args.calls)}
    if args.zmq:
        os.environ["NBREMOTE_UNIX"] = "0"  # (the workers started from now on inherit it)
        results["zmq"] = rounds("zmq ", args.rounds, args.calls)
    print()
    for label, (totals, seconds) in results.items():
        print(f"{label}: {args.rounds} rounds, " + ", ".join(f"{k} {v}" for k, v in totals.items())
              + f"; median {statistics.median(seconds):.1f} s a round")
    if "zmq" in results:
        ratio = statistics.median(results["unix"][1]) / statistics.median(results["zmq"][1])
        print(f"unix / zmq, median time a round: {ratio:.2f}")
    return 1 if any(totals[k] for totals, _ in results.values() for k in MUST_BE_ZERO) else 0


if __name__ == "__main__":
    sys.exit(main())
