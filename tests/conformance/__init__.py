"""torch's own RPC test suite, run against nbremote: the contract behind "programs written for
torch.distributed run with their imports and start-up changed" (issue 21).

``python -m tests.conformance`` imports the test modules that ship in the installed torch wheel,
unchanged -- ``rpc_test.py``, ``dist_autograd_test.py``, ``dist_optimizer_test.py``,
``nn/api/remote_module_test.py`` and ``rpc/examples/`` -- and runs every test method of their classes in a
world of four ranks, as torch's suite is written for: this process is ``worker0`` (rank 0), three worker
kernels are ``worker1..3``. It prints pass / fail / not applicable per file, with the reason for every
test that does not apply, and ``--check`` (what CI runs, through ``tests/test_conformance.py``) fails on
any failure but the known ones, and on a wrong not-applicable list.

* ``shim``: torch's module names (``torch.distributed.rpc``, ``.autograd``, ``.optim``, ``.nn``) pointed at
  nbremote's in every rank before the test modules are imported -- what a user porting a program does.
* ``ranks``: one rank of one test -- the fixture torch's classes need, fresh module globals per test, and
  nbremote's own start-up in a running world (``init_rpc`` joins it, ``shutdown`` is the driver's barrier),
  confined to the test's ranks.
* ``runner``: the world, the tests, each run on its ranks under one deadline; an overrun is cancelled,
  its stack kept, and the world restarted.
* ``verdicts``: the tests that do not apply, each with a reason and the evidence it must show, and the
  known failures, each explained.
* ``report``: the per-file totals and lists.

Measured here (2 cores, shared with other jobs): 470 tests in 166-207 s, 3-3.5 min with the world's start.
"""
