"""A process whose nbremote futures are still being completed by a daemon thread exits cleanly.

An nbremote future is a ``torch.futures.Future`` too (``frameworks._torch.FutureMirror``); completing its C++
side releases and retakes the GIL. A daemon thread that retakes it while the interpreter finalizes is ended
by ``pthread_exit``, and the unwinding through torch's C++ frame aborted the process ("terminate called
without an active exception", exit status -6): a driver whose IO thread completed a late reply as the
program ended (torch's DDP+RPC program, 2 runs in 3). Here the daemon threads make the first futures, so they may
still be importing the torch adapter as the program ends: what guards the exit must not wait for that import
to be registered (it failed 1 attempt in CI when it did).
"""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.timeout(120)


def test_completing_futures_in_a_daemon_thread_at_exit_does_not_abort() -> None:
    for attempt in range(3):
        out = run_script("""
            import threading, torch
            from nbremote.rpc import Future

            def complete_forever():
                while True:
                    Future().set_result(1)

            for _ in range(2):
                threading.Thread(target=complete_forever, daemon=True).start()
            print("exiting", flush=True)
        """, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "exiting", (
            f"attempt {attempt}: exit status {out.returncode}\n{out.stderr[-2000:]}")
