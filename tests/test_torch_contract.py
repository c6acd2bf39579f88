"""What code written for torch.distributed relies on, beyond the API's names (issue 21).

torch's own test suite checks all of it (``tests/conformance``, run by ``test_conformance.py``); these
are nbremote's own, smaller checks of each rule, with the reason it exists.
"""

from __future__ import annotations

import pytest
import remote_fns as fns
import torch
from conftest import run_script

from nbremote import rpc

pytestmark = pytest.mark.timeout(60)


# -- futures: nbremote's are torch's ---------------------------------------------------------------------


def test_torch_futures_functions_take_nbremote_futures(world: list[str]) -> None:
    futs = [rpc.rpc_async(w, fns.add, args=(i, 1)) for i, w in enumerate(world)]
    assert all(isinstance(f, torch.futures.Future) and isinstance(f, rpc.Future) for f in futs)
    assert torch.futures.wait_all(futs) == [1, 2, 3]
    collected = torch.futures.collect_all([rpc.rpc_async("worker1", fns.add, args=(2, 2))]).wait()
    assert [f.wait() for f in collected] == [4]
    failing = rpc.rpc_async("worker2", fns.fail, args=("value", "boom"))
    with pytest.raises(ValueError, match="boom"):  # its own type, through torch's wait_all too
        torch.futures.wait_all([rpc.rpc_async("worker1", fns.add, args=(1, 1)), failing])


def test_a_future_completes_once_and_then_needs_a_callable(world: list[str]) -> None:
    fut = rpc.rpc_async("worker1", fns.add, args=(1, 2))
    assert fut.wait() == 3
    with pytest.raises(RuntimeError, match="Future can only be marked completed once"):
        fut.set_result(4)
    with pytest.raises(TypeError, match="then\\(\\) takes a callable"):
        fut.then(None)  # type: ignore[arg-type]


def test_then_callback_errors_are_runtime_errors_of_their_own_type(world: list[str]) -> None:
    chained = rpc.rpc_async("worker1", fns.add, args=(1, 2)).then(lambda f: f.wait() + "x")
    with pytest.raises(TypeError, match="unsupported operand") as info:
        chained.wait()
    assert isinstance(info.value, RuntimeError)  # torch's type for a callback's error, as well as its own


def test_async_execution_may_return_a_torch_future_also_through_rref_proxies(world: list[str]) -> None:
    assert rpc.rpc_sync("worker1", fns.AsyncAdder.with_torch_future, args=(1,)) == 2
    rref = rpc.remote("worker1", fns.AsyncAdder, args=("worker2",))
    assert rref.rpc_sync().add_later(1, 2) == 30  # the method's future is awaited on the owner, not sent back
    assert rref.rpc_async().add_later(2, 2).wait() == 40
    assert rref.remote().add_later(3, 2).to_here() == 50
    assert rref.rpc_sync().with_torch_future(5) == 6
    with pytest.raises(TypeError, match=r"must return a torch\.futures\.Future object") as info:
        rpc.rpc_sync("worker1", fns.async_wrong_type)
    assert isinstance(info.value, RuntimeError)


# -- distributed autograd: sparse tensors, gradient buffers ------------------------------------------------


def test_sparse_tensors_keep_requires_grad_and_get_gradients_across_workers(world: list[str]) -> None:
    import nbremote.autograd as dist_autograd

    def sparse() -> torch.Tensor:
        return torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 2]], [3.2, 4.1, 5.3], (3, 3), requires_grad=True)

    t1, t2 = sparse(), sparse()
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("worker2", torch.add, args=(t1, t2))
        assert out.is_sparse and out.requires_grad  # torch's own pickling would have dropped requires_grad
        dist_autograd.backward(context_id, [torch.sparse.sum(out)])
        grads = dist_autograd.get_gradients(context_id)
        local = torch.autograd.grad([torch.sparse.sum(t1 + t2)], [t1, t2])
        for t, expected in zip((t1, t2), local, strict=True):
            assert grads[t].is_sparse and torch.equal(grads[t].to_dense(), expected.to_dense())


def test_gradients_never_share_a_buffer_and_are_contiguous(world: list[str]) -> None:
    """As torch's AccumulateGrad: a gradient given to two leaves, or strided unlike its leaf, is copied."""
    import nbremote.autograd as dist_autograd

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return a + b

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            return grad, grad  # one tensor for both inputs

    a, b = torch.randn(5, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [Twice.apply(a, b)[1][0]])
        grads = dist_autograd.get_gradients(context_id)
        assert grads[a].data_ptr() != grads[b].data_ptr()
        grads[a].add_(1)
        assert grads[b].sum() == 1  # the other leaf's gradient did not move
    c = torch.randn(4, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [(c.sum() * torch.ones(())).expand(4, 3)[0, 0]])
        kept = dist_autograd.get_gradients(context_id)[c]
        assert kept.is_contiguous() and kept.stride() == c.stride()


def test_hooks_of_a_leaf_run_on_its_gradient_also_when_it_comes_back_by_rpc(world: list[str]) -> None:
    """A tensor hook (``t.register_hook``) changes the gradient the context keeps, whether the pass reaches the
    leaf locally or as a hop from a worker; post hooks of its accumulation node run once per pass, with it."""
    import nbremote.autograd as dist_autograd

    t1 = torch.ones(3, 3, requires_grad=True)
    t1.register_hook(lambda grad: grad * 2)
    t2 = torch.ones(3, 3, requires_grad=True)
    for compute in (torch.matmul, lambda a, b: rpc.rpc_sync("worker1", torch.matmul, args=(a, b))):
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [compute(t1, t2).sum()])
            grads = dist_autograd.get_gradients(context_id)
            assert torch.equal(grads[t1], torch.full((3, 3), 6.0)) and torch.equal(grads[t2], torch.full((3, 3), 3.0))
    seen: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
    t = torch.rand(4, requires_grad=True)
    a = t + t
    a.grad_fn.next_functions[0][0].register_hook(lambda inputs, outputs: seen.append((inputs, outputs)))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [rpc.rpc_sync("worker2", torch.sum, args=(a,)) * 1.0])
        assert len(seen) == 1 and seen[0][0] == () and torch.equal(seen[0][1][0], torch.full((4,), 2.0))
        assert torch.equal(dist_autograd.get_gradients(context_id)[t], torch.full((4,), 2.0))
    with dist_autograd.context() as context_id:  # the leaf itself crosses: its gradient comes back as a hop
        dist_autograd.backward(context_id, [rpc.rpc_sync("worker2", torch.sum, args=(t,)) * 3.0])
        assert len(seen) == 2 and torch.equal(seen[1][1][0], torch.full((4,), 3.0))
    assert t.grad is None  # the context's, never .grad


# -- RRefs --------------------------------------------------------------------------------------------------


def test_rref_backward_locally_and_in_a_context(world: list[str]) -> None:
    import nbremote.autograd as dist_autograd

    t1 = torch.rand(10, 10, requires_grad=True)
    rpc.RRef(t1.sum() + t1.sum()).backward()  # an owner's RRef without a context: torch's local backward
    assert torch.equal(t1.grad, torch.full((10, 10), 2.0))
    t = torch.rand(10, requires_grad=True)
    with dist_autograd.context() as context_id:
        rref = rpc.remote("worker1", torch.sum, args=(t,))  # a user RRef: the pass starts on its owner
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        assert torch.equal(dist_autograd.get_gradients(context_id)[t], torch.full((10,), 2.0))
        with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id' to be specified"):
            rref.backward()
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward\(\)"):
            rpc.remote("worker1", fns.echo, args=("foo",)).backward(context_id)
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        rpc.RRef(torch.rand(3, requires_grad=True).sum()).backward(100)


def test_rref_type_and_creation_future(world: list[str]) -> None:
    rref = rpc.remote("worker1", fns.AsyncAdder, args=("worker2",))
    assert rref._get_type() is fns.AsyncAdder
    assert rref._get_type(blocking=False) is rref._get_type(blocking=False)  # asked once, then kept
    assert isinstance(rref._get_future(), torch.futures.Future)
    rref._get_future().wait()
    failed = rpc.remote("worker1", fns.fail, args=("value", "no value"))
    with pytest.raises(ValueError, match="no value"):
        failed._get_type()


def test_a_remote_proxy_refuses_a_missing_method_at_once(world: list[str]) -> None:
    """As torch's: rref.remote().missing() raises here, not at the new RRef's first use."""
    rref = rpc.remote("worker1", fns.AsyncAdder, args=("worker2",))
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        rref.remote().missing()
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        rref.rpc_sync().missing()
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        rref.rpc_async().missing().wait()


# -- RemoteModule ---------------------------------------------------------------------------------------------


def test_a_remote_module_handle_sent_by_rpc_can_send_its_dict_back(world: list[str]) -> None:
    """torch's tests read a handle's __dict__ on another worker; new attributes of the handle stay behind."""
    from nbremote.nn import RemoteModule

    rm = RemoteModule("worker1/cpu", torch.nn.Linear, args=(2, 2))
    rm.new_attr = 1
    rm(torch.ones(1, 2))  # the forward meter has counted
    attrs = rpc.rpc_sync("worker2", fns.attributes_of, args=(rm,))
    assert attrs["on"] == "worker1" and "new_attr" not in attrs
    assert attrs["_nbremote_meter"].snapshot().calls == 0  # a copy counts afresh


# -- start-up ---------------------------------------------------------------------------------------------


def test_torch_start_up_keywords_on_the_driver() -> None:
    """rank 0's start-up line of a ported program: world_size local kernels named as torch's ranks, the
    options' timeout; a fresh driver process."""
    out = run_script("""
        import torch.distributed.rpc as torch_rpc
        from nbremote import rpc
        rpc.init_rpc("worker0", backend=torch_rpc.BackendType.TENSORPIPE, rank=0, world_size=3,
                     rpc_backend_options=torch_rpc.TensorPipeRpcBackendOptions(rpc_timeout=7))
        try:
            print([w.name for w in rpc.workers()], rpc.get_rpc_timeout(), rpc.rpc_sync(2, abs, args=(-4,)))
        finally:
            rpc.shutdown()
    """, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "['worker0', 'worker1', 'worker2'] 7.0 4", out.stderr[-2000:]


def test_torch_start_up_of_another_rank_in_the_driver_says_what_differs(world: list[str]) -> None:
    """In a running world init_rpc joins it (tests/test_torch_startup.py): another rank's line is refused."""
    with pytest.raises(RuntimeError, match=r"'worker1' is not unique: it is rank 1's name; this process is 'driver'"):
        rpc.init_rpc("worker1", rank=1, world_size=4)
    with pytest.raises(ValueError, match="world_size=3, but the world is the driver and 1 workers"):
        rpc.init_rpc("other", workers=["w9"], world_size=3)
    with pytest.raises(TypeError, match="world_size is the number of processes"):
        rpc.init_rpc("other", world_size="4")  # type: ignore[arg-type]
    assert rpc.get_worker_info().name == "driver"  # the running world is untouched


def test_backend_options_and_type_as_torch_spells_them() -> None:
    """``rpc.TensorPipeRpcBackendOptions`` takes torch's keywords with torch's defaults and keeps what it is
    given; ``BackendType.TENSORPIPE`` and ``is_available()`` are there for a start-up line to name."""
    import inspect

    import torch.distributed.rpc as torch_rpc

    ours, theirs = (inspect.signature(cls.__init__).parameters for cls in
                    (rpc.TensorPipeRpcBackendOptions, torch_rpc.TensorPipeRpcBackendOptions))
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()]
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20, init_method="tcp://h:1",
                                              device_maps={"worker1": {0: 1}}, devices=[0])
    assert (options.num_worker_threads, options.rpc_timeout, options.init_method) == (8, 20.0, "tcp://h:1")
    assert isinstance(options, rpc.RpcBackendOptions)
    options.set_device_map("worker1", {"cuda:1": torch.device("cuda:2")})
    options.set_device_map("worker2", {0: 0})
    assert options.device_maps == {"worker1": {"cuda:0": "cuda:1", "cuda:1": "cuda:2"}, "worker2": {"cuda:0": "cuda:0"}}
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        options.set_device_map("worker1", {0: 3})
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"worker1": {0: 1, 2: 1}})
    assert options.devices == ["cuda:0"]
    with pytest.raises(ValueError, match="expect a list of CUDA devices"):
        options.set_devices(["cpu"])
    with pytest.raises(TypeError):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout="20")  # type: ignore[arg-type]
    assert repr(rpc.BackendType.TENSORPIPE) == "BackendType.TENSORPIPE" and list(rpc.BackendType) == [
        rpc.BackendType.TENSORPIPE]
    assert rpc.is_available() is True


def test_init_rpc_takes_nbremote_options_and_refuses_what_torch_refuses(world: list[str]) -> None:
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.init_rpc("other", backend="TENSORPIPE")
    with pytest.raises(TypeError, match="Argument rpc_backend_options must be an instance of RpcBackendOptions"):
        rpc.init_rpc("other", rpc_backend_options={"rpc_timeout": 3})
    assert rpc.get_worker_info().name == "driver"  # refused before the running world is looked at
    out = run_script("""
        from nbremote import rpc
        rpc.init_rpc("worker0", workers=[], backend=rpc.BackendType.TENSORPIPE,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=3, num_worker_threads=4))
        try:
            print(rpc.get_rpc_timeout(), rpc.rpc_sync("worker0", abs, args=(-2,)))
        finally:
            rpc.shutdown()
    """, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "3.0 2", out.stderr[-2000:]
