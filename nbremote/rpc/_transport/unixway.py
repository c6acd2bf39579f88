"""The part of a same-host ``KernelLink`` that lives with its Unix-domain connection (``unixlink``): the
backpressure that connection puts on the threads that send, and what goes by the kernel's zmq shell socket
once it ends -- in order, before anything new, exactly once."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import zmq

from nbremote.rpc._transport.base import Queued
from nbremote.rpc._transport.sockets import send_frames
from nbremote.rpc._transport.unixlink import HIGH_WATER, UnixChannel, received
from nbremote.rpc._wire.codec import Codec
from nbremote.rpc._wire.envelope import Buffer, Envelope

__all__ = ["UnixWay"]

log = logging.getLogger("nbremote")


class UnixWay(Queued):
    """A ``KernelLink``'s Unix-domain connection (``unixlink``), the part of the link that lives with it: the
    backpressure it puts on senders, and what goes by zmq once it ends."""

    unix: UnixChannel | None
    shell: zmq.Socket[Any]
    codec: Codec
    digests: bool
    name: str

    def send(self, env: Envelope, frames: Sequence[Buffer] = (), *, now: bool = False) -> None:
        unix = self.unix  # backpressure: a thread that reads nothing waits while the kernel lags far behind
        if unix is not None and unix.queued > HIGH_WATER:
            unix.wait_for_room(lambda: self.lost is not None)
        super().send(env, frames, now=now)

    def _by_unix(self, unix: UnixChannel, message: list[Any]) -> bool:
        """Under the outbox's lock: send ``message`` by ``unix``; False where it no longer takes messages. Once it is
        given up, what it owes goes by zmq first (``_fall_back``; what it took as it ended among it)."""
        took = unix.try_send(message)
        if unix.broken:
            self._fall_back(unix)
        return took

    def resend(self, messages: list[list[Any]]) -> None:
        """What a thread's Unix-domain connection owed the kernel when it ended (``threadsockets``): by the link's
        own way, between sends."""
        def send() -> None:
            unix = self.unix
            for message in messages:
                if unix is None or not self._by_unix(unix, message):
                    send_frames(self.shell, message)

        self.outbox.locked(send)

    def _fall_back(self, unix: UnixChannel) -> None:
        """Under the outbox's lock, once ``unix`` is given up: what the kernel may not have read whole of it goes
        by the shell socket, in order, before anything new (``UnixChannel.leftovers``: once)."""
        if (leftovers := unix.leftovers()) is None:
            return
        if leftovers or unix.failure is not None:  # (not a plain goodbye)
            log.info("worker %r: its Unix-domain connection ended (%s); back to its shell socket, %d message(s) "
                     "sent again", self.name, unix.failure or "closed", len(leftovers))
        for message in leftovers:
            send_frames(self.shell, message)

    def _receive_unix(self, unix: UnixChannel) -> list[tuple[Envelope, list[Buffer]]] | None:
        frames = unix.take()
        if frames is None:  # given up: the kernel's zmq channels say whether it lives, as they always did
            self.outbox.locked(lambda: self._fall_back(unix))
            return None
        return received(self.codec, frames, self.digests) if frames else None
