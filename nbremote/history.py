"""Per-parameter training history, recorded where the parameters live, while someone watches.

What a person training a model wants to see is how things *move*: whether a layer's gradients vanish or
explode, whether its weights stopped changing. The owner of a RemoteModule's parameters records, at every
optimizer step, for each parameter: its L2 norm after the step, its gradient's L2 norm, and the update ratio
``|w_after - w_before| / |w_before|``, each in a ring of the last :data:`STEPS` steps. A module's metric
stream (``RemoteModule.log(loss=...)``) lands in a ring beside them. A panel reads the rings with the
module's summary, in the one call its refresh makes anyway: recording costs no round trip per step.

**Off unless watched.** Nothing is recorded, and a step pays one empty-dict test, until a reader asks for a
module's history with a *lease* (``read(..., lease=seconds)``: the live panel renews it on every refresh).
When no read renews it -- the panel stopped refreshing or was closed, the notebook went away -- recording
stops by itself: a lapsed lease is noticed at the next step, which drops the module's parameters from the
recorder. ``lease=0`` stops at once; ``lease=None`` reads without watching.

**Where steps are seen.** ``DistributedOptimizer``'s local optimizer on each owner steps inside :func:`step`
(its gradients are the distributed autograd context's, put into ``.grad`` for the step), whichever process
runs the training loop. A loop that steps a plain torch or tensorplay optimizer in the owner's own kernel
(``%%remote``) is seen through the framework's global optimizer step hooks, installed only while something
is watched. Both frameworks have ``detach``, ``clone``, ``norm`` and ``stack``, which is all it takes.

**Cost when watched** (``benchmarks/bench_watch.py`` measures it on the training step, live panel and
dashboard included): per watched parameter and step, a copy of the weights before the step, then one
``_foreach_sub`` and one ``_foreach_norm`` over all of them and one conversion to Python floats (one device
sync on CUDA); per layer and forward, four small reductions. A :class:`_Pace` per module keeps that under
:data:`BUDGET` (1 %) of the time between its steps by recording every ``stride``-th step when steps are fast
(measured as it goes; ``ParameterHistory.step`` names the steps recorded).

**Flags** (NaN/inf, vanishing, exploding gradients) and the records that travel are plain values, in
``nbremote._history_values``, which documents the thresholds; this module re-exports them.
"""

from __future__ import annotations

import collections
import functools
import importlib
import math
import threading
import time
import weakref
from typing import Any

from nbremote import rpc
from nbremote._history_values import (
    EXPLODING,
    SPIKE,
    VANISHING,
    ActivationHistory,
    ModuleHistory,
    ParameterHistory,
    flags,
)
from nbremote.frameworks import tensor_key
from nbremote.rpc._core import owned_value

__all__ = ["BUDGET", "EXPLODING", "LEASE", "MAX_STRIDE", "METRIC_POINTS", "SPIKE", "STEPS", "VANISHING",
           "ActivationHistory", "ModuleHistory", "ParameterHistory", "Recorder", "flags", "log_metrics", "read",
           "recorder", "step"]

STEPS = 256  # steps each parameter's ring holds
METRIC_POINTS = 1024  # values each metric's ring holds
BUDGET = 0.01  # at most this share of the time between a module's steps goes to recording them (see _Pace)
MAX_STRIDE = 1000
LEASE = 10.0  # seconds a reader's watch lasts when no read renews it (the panel renews it every refresh)


class _Ring:
    """One parameter's rings (deques with a bound: memory stays flat however long training runs)."""

    __slots__ = ("grad", "name", "norm", "steps", "update", "watch")

    def __init__(self, name: str, watch: _Watch) -> None:
        self.name = name
        self.watch = watch
        self.steps: collections.deque[int] = collections.deque(maxlen=STEPS)  # the step number of each point
        self.norm: collections.deque[float] = collections.deque(maxlen=STEPS)
        self.grad: collections.deque[float] = collections.deque(maxlen=STEPS)
        self.update: collections.deque[float] = collections.deque(maxlen=STEPS)

    def history(self) -> ParameterHistory:
        return ParameterHistory(self.name, tuple(self.steps), tuple(self.norm),
                                tuple(self.grad), tuple(self.update))


class _Watch:
    """A watched module: its parameters' rings (kept while not watched: a panel shows them later) and lease."""

    def __init__(self, module: Any, recorder: Recorder) -> None:
        self.until = 0.0  # monotonic deadline of the last lease to lapse
        self.leases: dict[str, float] = {}  # reader -> monotonic deadline
        self.rings = {tensor_key(p): _Ring(name, self) for name, p in module.named_parameters()
                      if p.is_floating_point()}
        self.metrics: dict[str, collections.deque[tuple[float, float]]] = {}  # name -> (time logged, value)
        # leaf module name -> its outputs' (mean, std), as 2-element tensors: converted on read, so a forward
        # on a GPU waits for no device sync
        self.layers = [(name, m) for name, m in module.named_modules() if not any(True for _ in m.children())]
        self.outputs: dict[str, collections.deque[Any]] = {name: collections.deque(maxlen=STEPS)
                                                           for name, _ in self.layers}
        self.handles: list[Any] = []  # the forward hooks on the layers, while watched
        self.pace = _Pace(recorder)

    def hook(self) -> None:
        if not self.handles:
            self.handles = [m.register_forward_hook(functools.partial(self.record_output, name))
                            for name, m in self.layers]

    def unhook(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def record_output(self, name: str, module: Any, inputs: Any, output: Any) -> None:
        """A forward hook: the layer's output's mean and standard deviation (the first output if several)."""
        if self.until < time.monotonic() or not self.pace.forwards_due:  # lapsed (the next step or read takes
            return  # the hook away), or the coming step is not one recorded
        started = time.perf_counter()
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if not hasattr(out, "is_floating_point") or not out.is_floating_point() or out.numel() == 0:
            return
        lib = importlib.import_module(type(out).__module__.partition(".")[0])
        data = _as_float(lib, out.detach())
        mean = data.mean()  # (torch's std_mean measured no faster here, and tensorplay's has no correction=0)
        self.outputs[name].append(lib.stack([mean, ((data - mean) ** 2).mean().sqrt()]))
        self.pace.pending += time.perf_counter() - started

    def activations(self) -> tuple[ActivationHistory, ...]:
        found = []
        for name, ring in self.outputs.items():
            points = [t.tolist() for t in list(ring)]  # (mean, std)
            found.append(ActivationHistory(name, tuple(p[0] for p in points), tuple(p[1] for p in points)))
        return tuple(found)


class _Step:
    """One optimizer step being recorded (a context manager around it): the weights before it, the gradient norms."""

    __slots__ = ("before", "grads", "lib", "local", "number", "pace", "params", "prepared", "rings")

    def __init__(self, params: list[Any], rings: list[_Ring], local: threading.local, number: int,
                 pace: _Pace) -> None:
        started = time.perf_counter()
        self.params, self.rings, self.local, self.number, self.pace = params, rings, local, number, pace
        self.lib = importlib.import_module(type(params[0]).__module__.partition(".")[0])
        self.before = [_as_float(self.lib, p.detach()).clone() for p in params]
        # a parameter without a gradient learns nothing: its gradient norm is 0
        self.grads = [p.grad.detach() if p.grad is not None else self.lib.zeros(()) for p in params]
        self.prepared = time.perf_counter() - started

    def __enter__(self) -> None:
        self.local.step = self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.local.step = None
        if exc_type is None:  # a step that failed changed nothing worth a point
            resumed = time.perf_counter()
            self.after()
            self.pace.recorded(self.prepared + time.perf_counter() - resumed)  # the optimizer's own step left out

    def after(self) -> None:
        lib, n = self.lib, len(self.params)
        now = [_as_float(lib, p.detach()) for p in self.params]
        norms = _norms(lib, [*now, *_subtract(lib, now, self.before), *self.before, *self.grads])
        # one conversion (one device sync); tensors on several devices, rare, are converted one by one
        one_device = len({v.device for v in norms}) == 1
        numbers = lib.stack(norms).tolist() if one_device else [float(v) for v in norms]
        for i, ring in enumerate(self.rings):
            norm, delta, was, grad = numbers[i], numbers[n + i], numbers[2 * n + i], numbers[3 * n + i]
            ring.norm.append(norm)
            ring.grad.append(grad)
            ring.update.append(delta / was if was > 0 else (0.0 if delta == 0 else math.inf))
            ring.steps.append(self.number)


def _as_float(lib: Any, t: Any) -> Any:
    """Norms in float32 at least (a float16 norm overflows at 65504)."""
    return t if t.dtype == lib.float32 or t.dtype == lib.float64 else t.float()


def _norms(lib: Any, tensors: list[Any]) -> list[Any]:
    """L2 norms, in one call where the framework has it (``_foreach_norm``: 1 dispatch, not one per tensor)."""
    foreach = getattr(lib, "_foreach_norm", None)
    return list(foreach(tensors)) if foreach is not None else [t.norm() for t in tensors]


def _subtract(lib: Any, a: list[Any], b: list[Any]) -> list[Any]:
    foreach = getattr(lib, "_foreach_sub", None)
    return list(foreach(a, b)) if foreach is not None else [x - y for x, y in zip(a, b, strict=True)]


class _Pace:
    """How often a watched module records: every ``stride``-th optimizer step (and its forwards), chosen so that
    recording takes at most :data:`BUDGET` of the time between steps, whatever the model and the machine. Its
    cost is measured as it goes: for a stage of ``bench_watch.py``'s model, ~100 us a step against 5 ms steps,
    which recording each one would have made ~2 % of every step on each stage; a tiny model stepping in a local
    loop every 0.3 ms is recorded every ~30th step. ``ParameterHistory.step`` says which steps were."""

    __slots__ = ("cost", "count", "gap", "last", "pending", "recorder", "stride")

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder  # whose ``budget`` applies
        self.count = 0  # steps so far
        self.stride = 1
        self.last = 0.0  # when the last step began (perf_counter)
        self.gap = 0.0  # seconds between steps (a moving average)
        self.cost = 0.0  # seconds a recorded step costs, its forwards' hooks included (a moving average)
        self.pending = 0.0  # hooks' seconds since the last recorded step

    def due(self) -> bool:
        """A step begins: whether to record it."""
        now = time.perf_counter()
        if self.last:
            self.gap = now - self.last if not self.gap else 0.8 * self.gap + 0.2 * (now - self.last)
        self.last = now
        self.count += 1
        return (self.count - 1) % self.stride == 0

    @property
    def forwards_due(self) -> bool:
        """Whether the coming step will be recorded (its forwards' outputs are, then)."""
        return self.count % self.stride == 0

    def recorded(self, seconds: float) -> None:
        total, self.pending = seconds + self.pending, 0.0
        self.cost = total if not self.cost else 0.8 * self.cost + 0.2 * total
        if self.gap:
            self.stride = max(1, min(MAX_STRIDE, math.ceil(self.cost / (self.recorder.budget * self.gap))))


class _Skipped:
    """A watched step the pace leaves out: it only keeps the frameworks' hooks from taking it for another one."""

    __slots__ = ("local",)

    def __init__(self, local: threading.local) -> None:
        self.local = local

    def __enter__(self) -> None:
        self.local.step = self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.local.step = None


class _NoStep:
    """What a step records when nothing is watched: nothing (shared; entering it costs two empty calls)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        return None


_NOTHING = _NoStep()


class Recorder:
    """This process's watches (one per process, :data:`recorder`); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: weakref.WeakKeyDictionary[Any, _Watch] = weakref.WeakKeyDictionary()
        self._by_param: dict[int, _Ring] = {}  # what a step records into; empty: nothing is watched
        self._hooks: list[Any] = []  # the frameworks' global optimizer step hooks, while something is watched
        self._local = threading.local()  # the step being recorded on this thread, if any
        self.budget = BUDGET  # 1.0 records every step (the tests that check each one)

    @property
    def active(self) -> bool:
        return bool(self._by_param)

    def watch_of(self, module: Any) -> _Watch:
        with self._lock:
            watch = self._watches.get(module)
            if watch is None:
                watch = self._watches[module] = _Watch(module, self)
            return watch

    def renew(self, module: Any, lease: float, reader: str = "") -> bool:
        """``reader`` watches ``module`` for ``lease`` more seconds (0: no longer); returns whether it records now.
        Each reader has its lease (two panels of one module: closing one leaves the other's)."""
        watch = self.watch_of(module)
        with self._lock:
            now = time.monotonic()
            watch.leases = {r: until for r, until in watch.leases.items() if until > now and r != reader}
            if lease > 0:
                watch.leases[reader] = now + lease
            watch.until = max(watch.leases.values(), default=0.0)
            if watch.leases:
                self._by_param.update(watch.rings)
                watch.hook()
            else:
                self._drop(watch)
            self._sync_hooks()
        return bool(watch.leases)

    def _drop(self, watch: _Watch) -> None:
        watch.unhook()
        for key, ring in list(self._by_param.items()):
            if ring.watch is watch:
                del self._by_param[key]

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for watch in {ring.watch for ring in self._by_param.values()}:
                if watch.until < now:
                    self._drop(watch)
            self._sync_hooks()

    def step(self, params: list[Any]) -> _Step | _Skipped | _NoStep:
        """A context manager around an optimizer's step of ``params`` (their ``.grad`` set): records it where
        they are watched. Inside it, the frameworks' hooks record nothing (the step is recorded once)."""
        if not self._by_param or getattr(self._local, "step", None) is not None:
            return _NOTHING
        by_param = self._by_param
        watched = [(p, by_param[tensor_key(p)]) for p in params if tensor_key(p) in by_param]
        if not watched:
            return _NOTHING
        if any(ring.watch.until < time.monotonic() for _, ring in watched):
            self._expire()
            return self.step(params)
        pace = watched[0][1].watch.pace
        if not pace.due():
            return _Skipped(self._local)
        return _Step([p for p, _ in watched], [r for _, r in watched], self._local, pace.count - 1, pace)

    def log(self, module: Any, when: float, values: dict[str, float]) -> None:
        """One point of each metric, logged at ``when`` (the caller's clock): points sent one after the other
        may be served out of order (calls run on a pool), so each goes where its time puts it."""
        watch = self.watch_of(module)
        with self._lock:
            for name, value in values.items():
                ring = watch.metrics.get(name)
                if ring is None:
                    ring = watch.metrics[name] = collections.deque(maxlen=METRIC_POINTS)
                at = len(ring)
                while at > 0 and ring[at - 1][0] > when:
                    at -= 1
                if len(ring) == ring.maxlen and at == 0:
                    continue  # older than everything kept
                if len(ring) == ring.maxlen:
                    ring.popleft()
                    at -= 1
                ring.insert(at, (when, value))

    def history(self, module: Any, lease: float | None, reader: str = "") -> ModuleHistory:
        recording = self.renew(module, lease, reader) if lease is not None else self.recording(module)
        watch = self.watch_of(module)
        with self._lock:
            metrics = {name: tuple(ring) for name, ring in watch.metrics.items()}
            params = tuple(ring.history() for ring in watch.rings.values())
        return ModuleHistory(rpc.get_worker_info().name, recording, params, metrics, watch.activations())

    def recording(self, module: Any) -> bool:
        watch = self._watches.get(module)
        return watch is not None and watch.until >= time.monotonic() and any(
            ring.watch is watch for ring in self._by_param.values())

    # -- the frameworks' global hooks: plain optimizers stepped in this kernel --------------------------------
    def _sync_hooks(self) -> None:
        """Hooks installed while something is watched, removed when nothing is (called with the lock held)."""
        if self._by_param and not self._hooks:
            import sys

            for name in ("torch", "tensorplay"):
                optimizer = sys.modules.get(f"{name}.optim.optimizer")
                if optimizer is not None and hasattr(optimizer, "register_optimizer_step_pre_hook"):
                    self._hooks.append(optimizer.register_optimizer_step_pre_hook(self._pre_hook))
                    self._hooks.append(optimizer.register_optimizer_step_post_hook(self._post_hook))
        elif not self._by_param and self._hooks:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if getattr(self._local, "hooked", None) is not None:  # the last hooked step raised: no post hook came
            self._local.step = None
        step = self.step([p for group in optimizer.param_groups for p in group["params"]])
        step.__enter__()
        self._local.hooked = step

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step, self._local.hooked = getattr(self._local, "hooked", None), None
        if step is not None:
            step.__exit__(None, None, None)


recorder = Recorder()


def step(params: list[Any]) -> _Step | _Skipped | _NoStep:
    """For optimizers: ``with history.step(params): optimizer.step()``, the gradients in ``.grad``."""
    return recorder.step(params)


def read(module_rref: rpc.RRef[Any], lease: float | None, reader: str = "") -> ModuleHistory:
    """Runs on the owner: the module's history; ``reader``'s lease: ``lease`` seconds of watching from now."""
    return recorder.history(module_rref.local_value(), lease, reader)


def log_metrics(module_id: str, when: float, values: dict[str, float]) -> None:
    """Runs on the owner (a notification, no reply): one point of each of the module's metric streams."""
    recorder.log(owned_value(module_id), when, values)
