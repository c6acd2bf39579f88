"""``rpc.init_process_group``: a c10d group among named workers in one call, on real kernels (issue 40).

Groups of 2 and 3 in any order get rank = index and all-reduce what the arithmetic here says; DDP on a tiny
Linear in two workers averages their gradients; the errors name the worker and the fix; a group ends with
its world and when a member is removed or restarted, and a new one forms after any of these.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, own_worker, report, run_script

import nbremote
from nbremote import rpc
from nbremote.errors import NbRemoteError, UnknownWorkerError, WorkerError

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_groups_left(world: list[str]) -> Iterator[None]:
    yield
    rpc.destroy_process_group()


# -- what runs on the members ------------------------------------------------------------------------------
def group_info() -> tuple[bool, int, int, str]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return False, -1, -1, ""
    return True, dist.get_rank(), dist.get_world_size(), str(dist.get_backend())


def all_reduced(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values)
    dist.all_reduce(t)
    return [float(v) for v in t]


def ddp_grads(state: dict[str, Any], x: Any) -> list[Any]:
    """One forward and plain local backward of a DDP-wrapped Linear: DDP's reducer averages the gradients."""
    from torch.nn.parallel import DistributedDataParallel

    layer = torch.nn.Linear(4, 2)
    layer.load_state_dict(state)
    model = DistributedDataParallel(layer)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.module.parameters()]


def own_group() -> None:
    """A default group made by the worker's own code (a group of one), not by nbremote."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def hide_distributed(hidden: bool) -> None:
    """Make this kernel's torch look like a build without torch.distributed (a real kernel cannot lose it)."""
    import torch.distributed as dist

    if hidden:
        dist._nbremote_real_is_available = dist.is_available  # type: ignore[attr-defined]
        dist.is_available = lambda: False
    else:
        dist.is_available = dist._nbremote_real_is_available  # type: ignore[attr-defined]


def wait_until(what: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def timed_form(names: list[str]) -> float:
    start = time.perf_counter()
    rpc.init_process_group(names)
    return time.perf_counter() - start


# -- forming groups --------------------------------------------------------------------------------------------
def test_a_group_of_two_gets_its_ranks_and_all_reduces(world: list[str]) -> None:
    seconds = timed_form(["worker1", "worker2"])
    report("process groups", f"formed a gloo group of 2 local workers in {seconds * 1000:.0f} ms")
    assert rpc.rpc_sync("worker1", group_info) == (True, 0, 2, "gloo")
    assert rpc.rpc_sync("worker2", group_info) == (True, 1, 2, "gloo")
    assert rpc.rpc_sync("worker3", group_info)[0] is False, "a worker left out has no group"
    futs = [rpc.rpc_async(w, all_reduced, args=([1.0 * (r + 1), 10.0**r],)) for r, w in enumerate(world[:2])]
    assert [f.wait() for f in futs] == [[1.0 + 2.0, 1.0 + 10.0]] * 2


def test_a_group_of_three_in_any_order_ranks_by_position(world: list[str]) -> None:
    names = ["worker3", "worker1", "worker2"]
    seconds = timed_form(names)
    report("process groups", f"formed a gloo group of 3 local workers in {seconds * 1000:.0f} ms")
    for rank, name in enumerate(names):
        assert rpc.rpc_sync(name, group_info) == (True, rank, 3, "gloo"), name
    values = {name: [rank + 1.0, (rank + 1.0) ** 2, -rank] for rank, name in enumerate(names)}
    futs = {name: rpc.rpc_async(name, all_reduced, args=(values[name],)) for name in names}
    expected = [1 + 2 + 3, 1 + 4 + 9, 0 - 1 - 2]
    assert all(fut.wait() == expected for fut in futs.values())


def test_ddp_in_two_workers_averages_their_gradients(world: list[str]) -> None:
    rpc.init_process_group(["worker1", "worker2"], backend="gloo", timeout=30)
    gen = torch.Generator().manual_seed(40)
    layer = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    xs = [torch.randn(3, 4, generator=gen), torch.randn(5, 4, generator=gen)]
    futs = [rpc.rpc_async(w, ddp_grads, args=(state, x)) for w, x in zip(["worker1", "worker2"], xs, strict=True)]
    got = [f.wait() for f in futs]
    local = []  # each rank's own gradient, here: DDP's is their mean
    for x in xs:
        layer.zero_grad()
        layer(x).pow(2).sum().backward()
        local.append([p.grad.clone() for p in layer.parameters()])
    for i in range(2):
        assert torch.equal(got[0][i], got[1][i]), "DDP's ranks must hold the same gradient"
        assert torch.allclose(got[0][i], (local[0][i] + local[1][i]) / 2, atol=1e-6)
        assert not torch.allclose(local[0][i], local[1][i]), "the ranks' own gradients differ: the test can fail"


# -- errors -------------------------------------------------------------------------------------------------
def test_names_that_are_no_workers_are_refused(world: list[str]) -> None:
    with pytest.raises(UnknownWorkerError, match=r"no worker 'nobody'.*rpc.add_worker\('nobody'\)"):
        rpc.init_process_group(["worker1", "nobody"])
    with pytest.raises(ValueError, match="'driver' is the driver"):
        rpc.init_process_group(["driver", "worker1"])
    with pytest.raises(ValueError, match="named twice"):
        rpc.init_process_group(["worker1", "worker1"])
    with pytest.raises(TypeError, match="a list of worker names"):
        rpc.init_process_group("worker1")  # type: ignore[arg-type]
    assert rpc.rpc_sync("worker1", group_info)[0] is False, "nothing was formed"


def test_a_member_with_a_group_already_is_named_with_how_to_destroy_it(world: list[str]) -> None:
    rpc.init_process_group(["worker1", "worker2"])
    with pytest.raises(WorkerError, match=r"worker 'worker2' already has a default process group \(backend gloo, "
                                          r"rank 1 of 2, made by rpc.init_process_group\).*"
                                          r"rpc.destroy_process_group\(\['worker2'\]\)") as caught:
        rpc.init_process_group(["worker3", "worker2"])
    assert caught.value.worker == "worker2"
    assert rpc.rpc_sync("worker3", group_info)[0] is False, "the refused group left nothing behind"
    rpc.rpc_sync("worker3", own_group)
    with pytest.raises(WorkerError, match=r"worker 'worker3' already .* made by its own code"):
        rpc.init_process_group(["worker3"])
    rpc.destroy_process_group(["worker3"])  # whoever made it
    assert rpc.rpc_sync("worker3", group_info)[0] is False


def test_a_member_that_cannot_reach_the_store_is_named_with_the_address(world: list[str]) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 'worker2' could not reach the process group's store at "
                                          r"192\.0\.2\.1:\d+, served by 'worker1'.*master_addr=") as caught:
        rpc.init_process_group(["worker1", "worker2"], master_addr="192.0.2.1", rendezvous_timeout=1)
    assert caught.value.worker == "worker2"
    report("process groups", f"an unreachable store failed after {time.monotonic() - start:.1f} s "
                             "(rendezvous_timeout=1)")
    assert not any(rpc.rpc_sync(w, group_info)[0] for w in ("worker1", "worker2")), "nothing was kept"
    rpc.init_process_group(["worker1", "worker2"])  # and the same members form one at once
    assert rpc.rpc_sync("worker2", group_info) == (True, 1, 2, "gloo")


def test_torch_without_distributed_is_named(world: list[str]) -> None:
    rpc.rpc_sync("worker2", hide_distributed, args=(True,))
    try:
        with pytest.raises(WorkerError, match=r"worker 'worker2' cannot join a process group: .* no "
                                              r"torch.distributed \(torch.distributed.is_available\(\) is False"):
            rpc.init_process_group(["worker1", "worker2"])
    finally:
        rpc.rpc_sync("worker2", hide_distributed, args=(False,))
    assert rpc.rpc_sync("worker1", group_info)[0] is False


def test_nccl_where_a_member_has_no_cuda_is_named(world: list[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(WorkerError, match=r"worker 'worker1' has no CUDA device.*backend='gloo'"):
        rpc.init_process_group(["worker1", "worker2"], backend="nccl")


def test_a_worker_cannot_form_groups(world: list[str]) -> None:
    with pytest.raises(NbRemoteError, match="'worker1' is a worker: only the driver forms process groups"):
        rpc.rpc_sync("worker1", rpc.init_process_group, args=(["worker2"],))


# -- teardown with the world ---------------------------------------------------------------------------------
@pytest.fixture
def spare(world: list[str]) -> Iterator[str]:
    yield from own_worker("pg-spare")


def test_removing_a_member_destroys_the_others_group(spare: str) -> None:
    rpc.init_process_group(["worker1", spare])
    rpc.remove_worker(spare)
    assert wait_until(lambda: not rpc.rpc_sync("worker1", group_info)[0]), "worker1 kept a group with a missing rank"
    rpc.init_process_group(["worker2", "worker1"])
    assert rpc.rpc_sync("worker1", group_info) == (True, 1, 2, "gloo")


def test_restarting_a_member_destroys_the_group_and_it_forms_again(spare: str) -> None:
    rpc.init_process_group([spare, "worker2"])
    rpc.restart_worker(spare)
    assert wait_until(lambda: not rpc.rpc_sync("worker2", group_info)[0]), "worker2 kept a group with a dead rank"
    assert rpc.rpc_sync(spare, group_info)[0] is False
    rpc.init_process_group([spare, "worker2"])
    futs = [rpc.rpc_async(w, all_reduced, args=([2.0 + r],)) for r, w in enumerate([spare, "worker2"])]
    assert [f.wait() for f in futs] == [[5.0], [5.0]]


def destroy_and_make_own() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    own_group()


def test_the_end_of_a_group_leaves_a_group_the_user_made_since_alone(spare: str) -> None:
    rpc.init_process_group(["worker1", spare])
    rpc.rpc_sync("worker1", destroy_and_make_own)  # the user's own code replaced ours
    rpc.remove_worker(spare)  # which would end ours
    time.sleep(1.0)  # 20 of the watch's ticks
    assert rpc.rpc_sync("worker1", group_info) == (True, 0, 1, "gloo"), "the user's group was destroyed"


@pytest.fixture
def outside_kernels(tmp_path: Path) -> Iterator[list[Any]]:
    """Two kernels nbremote did not start: they outlive a world, and so would a group left in them."""
    from jupyter_client import KernelManager

    kms = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        for _ in range(2):
            km = KernelManager(kernel_name="python3")
            km.start_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            kms.append(km)
        yield kms
    finally:
        for km in kms:
            km.shutdown_kernel(now=True)


def _has_group(km: Any) -> bool:
    client = km.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=30)
        out: list[str] = []
        client.execute_interactive("import torch.distributed as _d; print('GROUP', _d.is_initialized())", timeout=30,
                                   output_hook=lambda m: out.append(m["content"].get("text", "")))
        return "GROUP True" in "".join(out)
    finally:
        client.stop_channels()


def test_a_group_ends_with_its_world_and_forms_in_the_next(world: list[str], outside_kernels: list[Any]) -> None:
    files = [km.connection_file for km in outside_kernels]
    out = run_script(f"""
        import nbremote
        from nbremote import rpc
        rpc.init_rpc("other-driver", workers={{"a": nbremote.AttachedKernel({files[0]!r}),
                                              "b": nbremote.AttachedKernel({files[1]!r})}})
        rpc.init_process_group(["a", "b"])
        import torch.distributed
        print("FORMED", rpc.rpc_sync("b", torch.distributed.get_rank))
        rpc.shutdown()
    """, timeout=90)
    assert "FORMED 1" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    for km in outside_kernels:  # nobody asks them anything meanwhile: they saw their world end
        assert wait_until(lambda km=km: not _has_group(km), timeout=10), "a group outlived its world"
    for i, path in enumerate(files):
        rpc.add_worker(f"outside{i}", nbremote.AttachedKernel(path))
    try:
        rpc.init_process_group(["outside1", "outside0"])
        assert rpc.rpc_sync("outside0", group_info) == (True, 1, 2, "gloo")
    finally:
        rpc.remove_worker("outside0")
        rpc.remove_worker("outside1")
    assert wait_until(lambda: not _has_group(outside_kernels[0]), timeout=10), "removed, it kept its group"


@pytest.fixture(scope="module")
def far_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker on another host (a network namespace with its own address: ``secondhost``), attached."""
    import secondhost

    if secondhost.unavailable() is not None:
        pytest.skip(f"no second host: {secondhost.unavailable()}")
    try:
        host = secondhost.SecondHost()
    except RuntimeError as exc:
        pytest.skip(f"no second host: {exc}")
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}  # this module, importable by reference there
        conn_file = host.start_worker(tmp_path_factory.mktemp("pgfar"), "pg-far", env=env)
        rpc.add_worker("pg-far", nbremote.AttachedKernel(conn_file))
        yield "pg-far"
        if "pg-far" in [w.name for w in rpc.workers()]:
            rpc.remove_worker("pg-far")
    finally:
        host.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", ["local first", "far first"])
def test_a_group_across_hosts_all_reduces(world: list[str], far_worker: str, order: str) -> None:
    """The store's address is the first member's as the others reach it: a local kernel's through the interface
    that leads to the other host, a far kernel's as the driver reaches it; gloo binds those interfaces."""
    names = ["worker1", far_worker] if order == "local first" else [far_worker, "worker1"]
    seconds = timed_form(names)
    report("process groups", f"formed a gloo group across two hosts ({order}) in {seconds * 1000:.0f} ms")
    futs = [rpc.rpc_async(w, all_reduced, args=([3.0 ** r, 1.0],)) for r, w in enumerate(names)]
    assert [f.wait() for f in futs] == [[1.0 + 3.0, 2.0]] * 2
    assert rpc.rpc_sync(names[1], group_info) == (True, 1, 2, "gloo")


def test_the_magic_lines_parse() -> None:
    from nbremote.jupyter._parse import MagicUsageError, WorkersCommand, parse_workers

    assert parse_workers("group a b --backend nccl") == WorkersCommand("group", ("a", "b"), backend="nccl")
    assert parse_workers("ungroup") == WorkersCommand("ungroup")
    assert parse_workers("ungroup b") == WorkersCommand("ungroup", ("b",))
    with pytest.raises(MagicUsageError, match="'group' needs at least one worker name"):
        parse_workers("group --backend gloo")
    with pytest.raises(MagicUsageError, match="unknown option '--backend' for 'start'"):
        parse_workers("start a --backend gloo")


def test_the_magic_forms_and_destroys_a_group(world: list[str]) -> None:
    from ipython_shell import open_shell, run

    with open_shell() as shell:
        ran = run(shell, "%remote_workers group worker2 worker1 --backend gloo")
        assert ran.error is None, ran
        assert "worker2 (rank 0), worker1 (rank 1)" in ran.out
        assert rpc.rpc_sync("worker1", group_info) == (True, 1, 2, "gloo")
        ran = run(shell, "%remote_workers ungroup worker1 worker2")
        assert ran.error is None, ran
    assert rpc.rpc_sync("worker1", group_info)[0] is False

