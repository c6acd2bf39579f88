"""What runs inside a worker kernel: the ``nbremote`` comm target and one channel per caller.

The driver's bootstrap ``execute_request`` calls :func:`install`, which makes this kernel's agent and
registers the comm target. Every caller (the driver, or a peer worker) opens its own comm, from its
own kernel subshell; the channel hands what arrives to the agent and sends straight through the
kernel's session onto IOPub under the comm's topic. (``Comm.send`` would work too, but it JSON-cleans
every message and records the sending thread's parent to re-route later comm messages, which would
move our comm off its subshell when a reply is sent from an executor thread.)

A channel is two-way: besides replies to its caller's requests, it carries this worker's own calls to
that caller, whose replies come back on the shell channel like any request. The driver is not a kernel
that workers could open a link to, so this is how a worker calls the driver (``rpc_sync("driver",
...)``, an RRef the driver owns): through the comm the driver opened.

Where ipykernel allows it, :func:`install` also sets up the faster *shell path* (``_worker.shellpath``); a
caller that asks for it in its ``comm_open`` gets a ``ShellLink`` beside its comm, and the ack says so.
The comm stays open either way: its close is the caller's goodbye, and it is the fallback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from nbremote.errors import WorkerStartError
from nbremote.rpc._core import current
from nbremote.rpc._core.agent import DEFAULT_TIMEOUT, Agent, current_agent_or_none
from nbremote.rpc._transport.base import CallerLink
from nbremote.rpc._transport.cpuwake import CPU_WAKE
from nbremote.rpc._wire import batching, envelope, sessions
from nbremote.rpc._wire.envelope import Buffer, Envelope
from nbremote.rpc._wire.lease import LEASE_SECONDS
from nbremote.rpc._worker import shellpath

CLOSE_DRAIN_S = 1.0  # s a comm's close waits for its caller's Unix-domain connections to be read to their end


class _Channel(CallerLink):
    """The comm one caller opened on this worker (a ``_transport.base.Link`` back to that caller): sending is a
    hand-off to the kernel's IOPub thread, cheap enough to do at once from any thread."""

    def __init__(self, kernel: Any, comm: Any, agent: Agent, caller: str, digests: bool, parent: Any) -> None:
        self.kernel = kernel
        self.comm = comm
        self.agent = agent
        self.name = caller
        self.digests = digests
        key = kernel.session.key
        self.mac = envelope.FrameMac(key if isinstance(key, bytes) else str(key).encode()) if digests else None
        self.parent = parent
        self.shell_link: shellpath.ShellLink | None = None  # the same caller by the shell path
        self.same_host = False
        # Replies finishing together on executor threads leave as one comm message (see batching.Outbox).
        self.outbox = batching.Outbox(self._send_batch)

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        del now  # always at once (see the class docstring)
        self.outbox.post(env, frames)
        self.outbox.drain()

    def _send_batch(self, items: list[batching.Item]) -> None:
        CPU_WAKE.touch()
        data, buffers = envelope.pack(items, mac=self.mac)
        self.kernel.session.send(self.kernel.iopub_socket, "comm_msg", {"comm_id": self.comm.comm_id, "data": data},
                                 parent=self.parent, ident=self.comm.topic, buffers=buffers)

    def on_msg(self, msg: dict[str, Any]) -> None:
        try:
            items = envelope.unpack(msg["content"].get("data"), msg.get("buffers") or [], mac=self.mac)
        except Exception as exc:  # a bad message must never take the kernel down
            print(f"nbremote: dropped a malformed message from {self.name!r}: {exc}", file=sys.__stderr__)
            return
        self.agent.receive(self.name, items, self)

    def on_close(self, msg: dict[str, Any]) -> None:
        del msg
        if self.shell_link is not None:  # what its Unix-domain connections still carry comes first
            self.shell_link.path.local.drain(self.shell_link, CLOSE_DRAIN_S)
        self.outbox.close()
        self.agent.detach_caller(self, "it closed its comm")
        if self.shell_link is not None:
            self.shell_link.path.unregister(self.shell_link)
            self.agent.detach_caller(self.shell_link, "it closed its comm")


def _ack_info(agent: Agent, subshell: bool) -> dict[str, Any]:
    return {"name": agent.name, "rank": agent.rank, "pid": os.getpid(), "host": socket.gethostname(),
            "python": sys.version.split()[0], "subshell": subshell,
            "inc": agent.table.incarnation}


def _connection_info() -> dict[str, Any] | None:
    """This kernel's own connection info (address, shell and heartbeat ports, key, CurveZMQ keys), for a
    caller that reaches us through a Jupyter server and asked for it (it holds the server's token: it can run
    any code here already); None where this is not an ipykernel application."""
    from ipykernel.kernelapp import IPKernelApp

    if not IPKernelApp.initialized():
        return None
    app = IPKernelApp.instance()
    key = app.session.key
    info: dict[str, Any] = {"ip": app.ip, "transport": app.transport, "shell_port": app.shell_port,
                            "hb_port": app.hb_port, "key": key.decode() if isinstance(key, bytes) else str(key),
                            "signature_scheme": app.session.signature_scheme}
    if app.curve_publickey is not None and app.curve_secretkey is not None:
        info["curve_publickey"], info["curve_secretkey"] = app.curve_publickey.decode(), app.curve_secretkey.decode()
    return info


def install(name: str, rank: int, sys_path: list[str] | None = None,
            timeout: float = DEFAULT_TIMEOUT, exit_with: str | None = None,
            after_driver: dict[str, Any] | None = None, world: str | None = None,
            members: list[str] | None = None) -> None:
    """Make this kernel an nbremote worker called ``name`` (idempotent).

    ``world`` and ``members``: the token of the world that bootstraps us and the names of its members. A
    kernel that is one of them already, under another name, refuses (``WorkerStartError``): becoming the
    second would leave the first without a kernel. A kernel of a world it has left (removed, or a driver
    that is gone) joins the new one under the new name.

    ``exit_with``: the driver that started this kernel through a provisioner or a Jupyter server. Such a
    kernel does not follow its driver's death the way a local child does (ipykernel's parent poller), so
    it ends when that driver's lease runs out (see ``_wire.lease``): it was started for that driver only.
    ``after_driver`` says how: ``{"how": "exit"}`` (a provisioned kernel), or ``{"how": "server", ...}``
    (a server would restart a kernel that exits: ask it to delete this one, ``_kernels.hosted.delete_own_kernel``).
    """
    import comm as comm_pkg
    from IPython import get_ipython

    for entry in sys_path or ():
        if entry not in sys.path:
            sys.path.append(entry)
    agent = current_agent_or_none()
    if (agent is not None and agent.running and agent.name != name and world is not None
            and agent.peers.world_token == world and agent.name in (members or ())):
        raise WorkerStartError(
            f"cannot add worker {name!r}: its kernel is already worker {agent.name!r} of this world, and a kernel is "
            f"one worker; call it {agent.name!r}, or rpc.remove_worker({agent.name!r}) first", name)
    if agent is None or agent.name != name or not agent.running:
        if agent is not None and agent.running:
            agent.close()
        agent = Agent(name, rank, "worker", timeout)
        agent.on_tick.append(_LeaseExpiry(agent))
        current.set_current(agent)
    else:
        agent.default_timeout = timeout
    agent.peers.world_members = None  # whoever bootstraps us is the driver of the world to come
    agent.peers.world_token = world
    kernel = get_ipython().kernel
    path = shellpath.install(kernel, agent)
    lease_control = _lease_on_control(kernel)
    channels: dict[str, list[_Channel]] = {}  # open comms by caller, closed when its lease runs out

    def expire(caller: str) -> None:
        for channel in channels.pop(caller, []):
            channel.comm.close()

    agent.on_expired.append(expire)
    if exit_with is not None:
        def end_after(caller: str) -> None:
            if caller != exit_with:
                return
            why = f"{caller!r}, which started this kernel, is gone"
            if (after_driver or {}).get("how") == "server":
                threading.Thread(target=_delete_via_server, args=(why, after_driver), daemon=True).start()
            else:
                _exit_kernel(why)

        agent.on_expired.append(end_after)

    def on_open(comm: Any, msg: dict[str, Any]) -> None:
        data = msg["content"].get("data") or {}
        member = current_agent_or_none() or agent
        caller, digests = str(data.get("caller", "?")), bool(data.get("digests"))
        channel = _Channel(kernel, comm, member, caller, digests, msg)
        if not member.peers.admits(caller):
            why = (f"{caller!r} is not a member of the world of worker {member.name!r} "
                   f"(members: {', '.join(sorted(member.peers.world_members or ()))})")
            print(f"nbremote: refused a comm: {why}", file=sys.__stderr__, flush=True)
            channel.send({"k": "ack", "info": {"refused": why}})
            comm.close()
            return
        # Replace (not register with) the comm's handler: Comm.handle_msg fires IPython's pre/post_execute
        # events around every message, which is cell machinery (autoreload, inline plots) an RPC must
        # not trigger, and which costs time on every call.
        comm.handle_msg = channel.on_msg
        comm.on_close(channel.on_close)
        channel.same_host = member.shm.sees(data.get("shm"))
        shell = data.get("shell")
        if path is not None and isinstance(shell, dict):
            try:
                tx, rx = shell.get("tx"), shell.get("rx")
                channel.shell_link = path.register(
                    caller, None if tx is None else bytes.fromhex(tx), None if rx is None else bytes.fromhex(rx),
                    digests, channel.same_host, token=shell.get("token"))
            except (TypeError, ValueError):
                channel.shell_link = None  # a malformed offer: the comm path still works
        info = _ack_info(member, msg["header"].get("subshell_id") is not None)
        info["shell"] = channel.shell_link is not None
        info["shm"], info["shm_seen"] = member.shm.probe, channel.same_host
        if channel.same_host and channel.shell_link is not None and path is not None:
            info["unix"] = path.local.offer()  # a socket of its own for this caller (``localsock``)
        if data.get("direct") and channel.shell_link is not None and not channel.same_host:
            info["direct"] = _connection_info()  # a caller through a server may reach our ports (_transport.direct)
        info["lease"] = LEASE_SECONDS  # how often the caller must be heard from (see _wire.lease)
        info["lease_control"] = lease_control  # and whether by its kernel_info_requests (``_lease_on_control``)
        channel.send({"k": "ack", "info": info})
        member.attach_caller(channel)
        channels.setdefault(caller, []).append(channel)

    comm_pkg.get_comm_manager().register_target(envelope.COMM_TARGET, on_open)
    _quiet_status(kernel)
    _unbounded_iopub(kernel)
    _keep_off_user_rng(get_ipython(), kernel)


class _LeaseExpiry:
    """A worker's tick hook: a caller not heard from for ``LEASE_SECONDS`` (see ``nbremote.rpc._wire.lease``)
    is gone for good, and what it held here is freed (``Agent.forget_caller``); the ``on_expired`` hooks
    close its comms and end a kernel started for a driver that is gone."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.last = time.monotonic()

    def __call__(self, now: float) -> None:
        agent = self.agent
        stalled = now - self.last - 0.5  # ticks come every 50 ms: a gap is a stall of ours, not their silence
        if stalled > 0:
            agent.leases.extend(stalled)
        self.last = now
        for caller in agent.leases.expired(now):
            why = f"its lease ran out: nothing heard from it for {LEASE_SECONDS:.0f} s"
            freed, contexts = agent.forget_caller(caller, why)
            for hook in list(agent.on_expired):
                with contextlib.suppress(Exception):
                    hook(caller)
            print(f"nbremote: {caller!r} was not heard from for {LEASE_SECONDS:.0f} s: released what it held here "
                  f"({freed} value(s), {contexts} autograd context(s))", file=sys.__stderr__, flush=True)


def _delete_via_server(why: str, plan: Any) -> None:
    from nbremote.rpc._kernels.hosted import delete_own_kernel

    try:
        done = delete_own_kernel(plan)
    except Exception as exc:  # the server's culling is the fallback; say why in the worker's log
        done = f"could not ask its server to delete it ({exc})"
    print(f"nbremote: {why}: {done}", file=sys.__stderr__, flush=True)


def _exit_kernel(why: str) -> None:
    """End this kernel and what it started (a provisioner's launcher forks a signal listener beside it).

    SIGTERM to our process group: the group is the kernel's own (started in a new session by
    jupyter_client, or behind ``nohup`` in a shell that has exited), never the driver's.
    """
    print(f"nbremote: exiting: {why}", file=sys.__stderr__, flush=True)
    with contextlib.suppress(OSError):
        if os.getpgrp() != os.getpgid(os.getppid()):  # never a group our parent is in
            os.killpg(os.getpgrp(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)


def _lease_on_control(kernel: Any) -> bool:
    """Renew a caller's lease by the ``kernel_info_request`` it sends on the control channel every second
    (``zmqlink.KernelLink.heartbeat``), which names it: the control thread answers that however busy the
    shell path is, so a lease never waits behind data -- a burst queued on the caller's link, every receiving
    thread busy with a call. (A caller without control access, through a server, renews by ``lease``
    envelopes on its data path.) False where this kernel has no control handler to extend."""
    handlers = getattr(kernel, "control_handlers", None)
    handler = handlers.get("kernel_info_request") if isinstance(handlers, dict) else None
    if handler is None:
        return False
    if getattr(handler, "_nbremote", False):
        return True

    def kernel_info_request(stream: Any, ident: Any, parent: dict[str, Any]) -> Any:
        caller = (parent.get("content") or {}).get("nbremote_lease")
        agent = current_agent_or_none()  # (whichever this kernel is now)
        if isinstance(caller, str) and agent is not None:
            agent.leases.heard(caller)
        return handler(stream, ident, parent)

    kernel_info_request._nbremote = True  # type: ignore[attr-defined]
    handlers["kernel_info_request"] = kernel_info_request  # type: ignore[index]
    return True


def _unbounded_iopub(kernel: Any) -> None:
    """Let the kernel's IOPub socket queue what a subscriber has not read yet, instead of dropping it.

    The comm path (ipykernel < 7, or ``NBREMOTE_SHELL_PATH=0``) carries our replies and calls as comm
    messages on IOPub, a PUB socket: past its SNDHWM (1,000 messages by default) it drops, without a word,
    what a subscriber has not taken yet -- a burst of 2,000 calls lost hundreds. The shell socket had the
    same limit (``shellpath.install``). Set on the IOPub thread, which owns the socket.
    """
    thread = getattr(kernel, "iopub_thread", None)
    socket, loop = getattr(thread, "socket", None), getattr(thread, "io_loop", None)
    if socket is not None and loop is not None:
        loop.add_callback(lambda: setattr(socket, "sndhwm", 0))


def _keep_off_user_rng(shell: Any, kernel: Any) -> None:
    """Serve nbremote without drawing from the user's ``random`` (issue 40).

    ipykernel answers every ``kernel_info_request`` with ``shell.banner``, and IPython 9 ends the banner
    with a "Tip" it picks by ``random.choice`` on the global stream: the driver's session check asks once
    a second, so an idle worker's seeded ``random`` moved every second. No tip (IPython's own switch, where
    this IPython has one) keeps the rest of the banner. The kernel session's replay history is culled
    with a generator of its own (``_wire.sessions``).
    """
    if shell is not None and shell.has_trait("enable_tip"):
        shell.enable_tip = False
    sessions.own_rng(kernel.session)


def _quiet_status(kernel: Any) -> None:
    """Publish no busy/idle status for nbremote's comm messages.

    ipykernel announces busy and idle on IOPub around every shell message. For an RPC these are two
    extra messages through the IOPub thread per call, which is most of what separates a call from the
    wire's latency, and a frontend attached to the worker would flicker "busy" on every RPC. Cells
    and every other message keep their status.
    """
    publish = getattr(kernel, "_publish_status", None)
    if publish is None or getattr(publish, "_nbremote", False):
        return

    def _publish_status(status: str, channel: str, parent: Any = None) -> None:
        msg = parent or kernel.get_parent(channel)
        header = (msg or {}).get("header") or {}
        if header.get("msg_type") in ("comm_msg", "kernel_info_request") and str(header.get("username")) == "nbremote":
            return  # an RPC on the comm path, or the caller checking it still talks to this kernel
        publish(status, channel, parent)

    _publish_status._nbremote = True  # type: ignore[attr-defined]
    kernel._publish_status = _publish_status
