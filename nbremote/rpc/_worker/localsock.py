"""Same-host callers' own Unix-domain connections to this kernel (``_transport.unixlink``), kernel side.

A caller that proved it shares this machine (``shm``) is offered the path of a listening socket in its
``comm_open`` ack (``offer``). Each connection introduces itself with a ``ping`` signed with the kernel's key,
naming the link it belongs to by that link's sending identity on the shell socket and saying whether it is
the link's own (``main``: from then on the link sends there) or one of its threads' (``thread``: a new
alias, which gets the replies to that thread's calls); it is answered ``pong`` and handed to the receiving
threads (``receivers``). A forged, malformed, silent or unknown introduction is closed unanswered. Before a
comm's close is served, what its caller's connections still carry is read (``drain``): the caller finished
them (``UnixChannel.finish``) before it sent the close by the shell socket.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from typing import Any

from nbremote.rpc._transport.shm import SHM_DIR, reap_on_exit
from nbremote.rpc._transport.unixlink import (
    HELLO_BYTES,
    HELLO_TIMEOUT,
    MAX_BYTES,
    UnixChannel,
    received,
    unix_wanted,
)
from nbremote.rpc._wire.codec import Codec
from nbremote.rpc._wire.envelope import Envelope

__all__ = ["LocalSockets"]


def _log(text: str) -> None:
    print(f"nbremote: {text}", file=sys.__stderr__, flush=True)  # the worker's log file


class LocalSockets:
    """The listening socket of one kernel's shell path (``shellpath.ShellPath``), made when first offered."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self._listener: UnixListener | None = None

    def offer(self) -> str | None:
        """Where a caller on this machine may connect; None where nothing is offered (``NBREMOTE_UNIX=0``, no
        receiving threads to read connections, no ``epoll``, or no socket could be made)."""
        if self._listener is None:
            if not (unix_wanted() and self.path.receivers.can_read_channels()):
                return None
            try:
                self._listener = UnixListener(self._accepted)
            except OSError as exc:
                _log(f"no Unix-domain socket for callers on this machine ({exc}); they keep to the shell socket")
                return None
        return self._listener.path

    @property
    def where(self) -> str | None:
        return None if self._listener is None else self._listener.path

    def drain(self, link: Any, timeout: float) -> None:
        """Wait (at most ``timeout``) until the receiving threads have read ``link``'s connections, and its
        aliases', to their end."""
        channels = [each.unix for each in (link, *link.aliases) if each.unix is not None]
        deadline = time.monotonic() + timeout
        while any(self.path.receivers.reads(channel) for channel in channels) and time.monotonic() < deadline:
            time.sleep(0.005)

    def _accepted(self, channel: UnixChannel) -> None:
        """A new connection (on a short-lived thread of its own): read its introduction, answer, hand it on."""
        link = None
        try:
            channel.limit = HELLO_BYTES  # nobody known yet: nothing big is allocated for it
            frames = channel.receive_within(HELLO_TIMEOUT)
            channel.limit = MAX_BYTES
            key = self.path.kernel.session.key  # a codec of its own: the introduction is read on this thread
            codec = Codec(key if isinstance(key, bytes) else str(key).encode(),
                          signature_scheme=self.path.kernel.session.signature_scheme)
            link = self._introduced(channel, received(codec, frames, False) if frames else [])
            if link is not None:
                channel.send(self.path.codec.encode_items([({"k": "pong"}, ())]))
        except Exception as exc:  # a forged, malformed or silent introduction: no link
            _log(f"refused a Unix-domain connection: {type(exc).__name__}: {exc}")
            link = None
        if link is None:
            channel.shut()
            channel.close()
            return
        self.path.receivers.add_channel(channel, link)

    def _introduced(self, channel: UnixChannel, items: list[tuple[Envelope, list[Any]]]) -> Any:
        """The link an introduction names (the connection attached to it), or None."""
        for env, frames in items:
            role = env.get("unix")
            if env["k"] != "ping" or frames or role not in ("main", "thread") or not isinstance(env.get("link"), str):
                continue
            main = self.path.caller_link(bytes.fromhex(env["link"]))
            if main is None or not main.same_host:
                return None
            if role == "main":
                old, main.unix = main.unix, channel
                if old is not None:
                    old.shut()
                return main
            alias = self.path.alias(main)
            alias.unix = channel
            return alias
        return None


class UnixListener:
    """A kernel's listening socket (see the module docstring for where, and who removes it); a thread of its
    own accepts connections and hands each to ``accepted(channel)`` (which reads its introduction)."""

    def __init__(self, accepted: Any) -> None:
        self.path = str(SHM_DIR / f"nbr-{os.getpid()}-{os.urandom(4).hex()}-sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # its mode comes from the umask until the chmod; whoever connects in between must still introduce
            # itself with the kernel's key, as every connection must
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)
        except OSError:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        reap_on_exit()  # this process's shared-memory names, the socket's among them, are unlinked as it ends
        self._sock.listen(64)
        self._accepted = accepted
        self._closed = False
        atexit.register(self.close)
        threading.Thread(target=self._accept, name="nbremote-unix-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of descriptors, say: try again, never spin
                continue
            threading.Thread(target=self._accepted, args=(UnixChannel(sock),),
                             name="nbremote-unix-hello", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
