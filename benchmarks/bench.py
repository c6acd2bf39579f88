"""Compare nbremote with raw pyzmq, torch.distributed.rpc and ipyparallel, in one run on one machine.

``python benchmarks/bench.py [--quick] [--json out.json] [--only CASE,...] [--rounds N]``

Systems, each started once and kept alive for the whole run (world start aside):

- **nbremote**: this process is the driver, with 4 local worker kernels;
- **torch** / **torch-uv**: torch.distributed.rpc worlds of spawned processes (rank 0 + 4 workers),
  TensorPipe's default transports (shared memory on one host) and uv (TCP) only. Rank 0 runs the very
  program nbremote's driver runs (``_apirunner``), on commands sent over a pipe, and times itself;
- **raw zmq**: a REQ/REP echo server in a spawned process, the floor of calls and echoes;
- **ipyparallel**, when installed: a local cluster of 3 engines (``apply_sync`` / ``apply_async``);
- **local**: the RemoteModule's forward and the training step computed in this process, for orientation.

Cases (``--only`` takes their ids or groups): ``small`` call (``rpc_sync(w, noop)``; nbremote also with a
``__main__`` function, as in a notebook, which cloudpickle ships by value); ``echo`` of 1, 16 and 64 MB of
float32 as numpy and as a torch tensor, each path checked bit-exact once; ``burst``: 1,000 ``rpc_async(noop)``
in flight round robin to 1 and to 3 workers, calls/s from first submit to last completion; ``module``:
``RemoteModule`` forward of ``Linear(16, 16)`` on a batch of 32 against torch's RemoteModule; ``train``: one
step of a split model (two remote stages, a local head, distributed autograd and optimizer); ``train4``: one
step of a 4-stage MLP over four workers (batch 64), plain and pipelined with 4 micro-batches (``pipe4``:
torch as its pipeline example does it, with RRefs to shards; nbremote with ``RemoteSequential``, each stage
calling the next; ``pipe4rref``: nbremote with torch's pattern, ``remote_forward``); ``ps``: a
parameter server with two trainers running their loops at once (steps/s); ``start``: a
world of 1 and of 4 workers brought up until a call to each returned. Every function called remotely lives
in ``_fns`` or ``_models``, imported by name on every side (nbremote is not charged for pickling code).

Method: the cases of a group run in rounds; in each round every system runs one block of each case, in an
order rotated from round to round, so drift on a busy machine hits every system alike. Medians and p90 are
over all samples; ratios are *paired*: the median over rounds of the ratio of the two systems' round
medians, so a burst of load elsewhere cancels out. Targets (issue 9) are judged on those ratios. The load
before and after is printed: on a 2-core machine any other process inflates every figure. That includes
the kept worlds themselves: TensorPipe's default transport polls busily (an idle torch world keeps both
cores busy), so a world found doing that when the systems start is stopped (SIGSTOP) while the others run
their blocks and goes on (SIGCONT) for its own (``_harness``); the notes say so. Before that, every other
system was measured on cores that torch's idle world was taking.

Every process computes on one thread (``OMP_NUM_THREADS=1`` unless set otherwise): with torch's default of
two intra-op threads, a local training step on 2 busy cores took 50 ms instead of 1-2 ms at the median,
its threads waiting at OpenMP barriers for a descheduled peer, and that noise would swamp what is compared.

``--quick`` is a smoke run (tiny samples and sizes, still every system and path): it proves the paths
work, and its figures mean nothing. Exit status 1 when any system failed or a check did not hold.
"""

import os
import sys


def noop_in_main() -> None:
    """The small call's function as a notebook cell defines it: in ``__main__``, so shipped by value."""
    return None


if __name__ == "__main__":
    # One compute thread per process, in every process (children inherit it), unless set: see the docstring.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    from _cli import main  # benchmarks/ is sys.path[0]; spawned children import this file without running it

    sys.exit(main(sys.argv[1:], noop_in_main, __doc__.splitlines()[0]))
