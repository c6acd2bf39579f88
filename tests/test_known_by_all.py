"""``init_rpc`` / ``add_workers`` return only when every member can name every other, as torch's ``init_rpc`` does
(issue 40: right after ``init_rpc``, a worker calling ``'driver'`` by name failed with ``UnknownWorkerError`` in
2 of 33 fresh worlds -- the membership broadcast and the first call went by different connections)."""

from __future__ import annotations

import pytest
from conftest import run_script

from nbremote import rpc
from nbremote.rpc._core.agent import known_names

pytestmark = pytest.mark.timeout(120)


def test_every_member_names_every_other_once_init_rpc_returned(world: list[str]) -> None:
    everyone = sorted(["driver", *world])
    for w in world:
        assert sorted(rpc.rpc_sync(w, known_names)) == everyone, w


def test_fresh_worlds_call_the_driver_and_each_other_by_name_at_once() -> None:
    out = run_script("""
        import os
        from nbremote import rpc

        def around():  # runs on a worker the moment init_rpc returned: the driver and the other worker by name
            return rpc.rpc_sync("driver", os.getpid), rpc.get_worker_info("worker2").name

        for i in range(6):
            rpc.init_rpc("driver", workers=["worker1", "worker2"])
            try:
                pid, other = rpc.rpc_sync("worker1", around)
                assert pid == os.getpid() and other == "worker2", (pid, other)
            finally:
                rpc.shutdown()
        print("ok", i + 1)
    """, timeout=110)
    assert out.returncode == 0 and "ok 6" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
