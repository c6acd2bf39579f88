"""How a remote cell's output is shown in the calling cell: the default handler of ``rpc.run_cell``.

Text (stream output, tracebacks, results that are only text) is written on this process's stdout /
stderr with every line labelled ``[worker]``, like the output of RPCs (``capture.emit``). A rich
output (an image, HTML) is displayed as it is, after a ``[worker]`` label line. Widgets live in the
worker's kernel, which the notebook's frontend is not connected to, so their views are dropped and
their ``text/plain`` fallback is shown. Display ids are prefixed with the worker's name, so
``update_display`` on a worker updates that worker's output and nothing of the driver's.
Outside IPython (a script as driver) everything is shown as labelled text.
"""

from __future__ import annotations

import sys
from typing import Any

from nbremote.rpc._core import capture

_WIDGET_TYPES = ("application/vnd.jupyter.widget-view+json", "application/vnd.jupyter.widget-state+json")


def _ipython() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipykernel
        return None
    return get_ipython()


class CellOutput:
    """Shows the output of one run (``handler(worker, msg_type, content)``)."""

    def __init__(self, workers: tuple[str, ...]) -> None:
        self._single = len(workers) == 1
        self._line_start: dict[tuple[str, str], bool] = {}

    def __call__(self, worker: str, msg_type: str, content: dict[str, Any]) -> None:
        if msg_type == "stream":
            self._text(worker, content.get("name", "stdout"), content.get("text", ""))
        elif msg_type == "error":
            self._text(worker, "stderr", "\n".join(content.get("traceback", [])) + "\n")
        elif msg_type == "clear_output":
            # One worker's clear would wipe the others' output too: honoured for a single worker only.
            if self._single and _ipython() is not None:
                from IPython.display import clear_output

                clear_output(wait=bool(content.get("wait")))
        elif msg_type in ("display_data", "update_display_data", "execute_result"):
            self._rich(worker, msg_type, content)

    def _text(self, worker: str, stream: str, text: str) -> None:
        key = (worker, stream)
        self._line_start[key] = capture.emit(worker, stream, text, self._line_start.get(key, True))

    def _rich(self, worker: str, msg_type: str, content: dict[str, Any]) -> None:
        data = {k: v for k, v in (content.get("data") or {}).items() if k not in _WIDGET_TYPES}
        if not data:
            return
        prompt = f"Out[{content['execution_count']}]: " if msg_type == "execute_result" else ""
        text_only = set(data) <= {"text/plain"}
        if text_only or _ipython() is None:
            text = str(data.get("text/plain", f"<{', '.join(sorted(data))} output>"))
            self._text(worker, "stdout", prompt + text + "\n")
            return
        from IPython.display import display, update_display

        display_id = (content.get("transient") or {}).get("display_id")
        if display_id is not None:
            display_id = f"{worker}-{display_id}"
        if msg_type == "update_display_data":
            if display_id is not None:
                update_display(data, raw=True, metadata=content.get("metadata") or {}, display_id=display_id)
            return
        self._text(worker, "stdout", (prompt or "\u2193") + "\n")  # the label line, then the output itself
        sys.stdout.flush()  # so the label is shown before the output it labels
        display(data, raw=True, metadata=content.get("metadata") or {}, display_id=display_id)
