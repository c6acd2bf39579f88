"""A live line in the cell while workers wait to start: ``w1: PENDING (Resources), job 123, 0:42 in queue``.

``%remote_workers start ... --slurm`` blocks the cell while its jobs wait in Slurm's queue, which may take
minutes; :func:`start_status` shows where each start is (``rpc.worker_status()``'s detail of a starting
worker: one ``squeue`` poll of the driver's serves them all) once the wait passes ``threshold`` s, updated every
``tick`` s, and finalised when the start returns (up, or failed). As ``_progress.WaitStatus`` does, it displays
from a thread of its own in the waiting cell's context (``contextvars``), which is how ipykernel routes output
from other threads.
"""

from __future__ import annotations

import contextlib
import contextvars
import html
import threading
import time
from collections.abc import Iterator

from nbremote import rpc

__all__ = ["start_status"]


def _bundle(text: str, colour: str) -> dict[str, str]:
    return {"text/plain": text,
            "text/html": f'<span style="font-size:12px;color:{colour};white-space:pre">{html.escape(text)}</span>'}


def _where(names: tuple[str, ...]) -> str:
    """One line per starting worker of ``names`` (those not starting any more are left out)."""
    try:
        rows = {r.name: r for r in rpc.worker_status()}
    except Exception:  # the world is not there yet, or has just failed: nothing to say
        return ""
    return "\n".join(f"\u23f3 {n}: {rows[n].detail}" for n in names if n in rows and rows[n].state == "starting")


@contextlib.contextmanager
def start_status(names: tuple[str, ...], threshold: float = 1.0, tick: float = 1.0) -> Iterator[None]:
    """Show where the starts of ``names`` are while the block runs (see the module docstring)."""
    from IPython.display import display, update_display

    ctx = contextvars.copy_context()
    display_id = f"nbremote-start-{id(names)}-{time.monotonic_ns()}"
    shown = threading.Event()
    stop = threading.Event()
    began = time.monotonic()

    def watch() -> None:
        if stop.wait(threshold):
            return
        while True:
            text = _where(names)
            if text:
                ctx.run(update_display if shown.is_set() else display, _bundle(text, "#1f5fa8"), raw=True,
                        display_id=display_id)
                shown.set()
            if stop.wait(tick):
                return

    thread = threading.Thread(target=watch, name="nbremote-start-status", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join(5)
        if shown.is_set():
            took = time.monotonic() - began
            text, colour = ((f"\u2713 {', '.join(names)} up in {took:.1f} s", "#1b7f3b") if ok else
                            (f"\u2717 starting {', '.join(names)} failed after {took:.1f} s", "#b00020"))
            ctx.run(update_display, _bundle(text, colour), raw=True, display_id=display_id)
