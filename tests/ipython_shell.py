"""An in-process IPython shell with nbremote loaded, and running cells in it with their output captured.

IPython makes its user namespace ``sys.modules["__main__"]`` (classes defined in cells then travel by
value, as from a notebook); :func:`open_shell` puts pytest's own ``__main__`` back when closed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from IPython.core.interactiveshell import ExecutionResult, InteractiveShell
from IPython.utils.capture import capture_output


@dataclass
class Ran:
    """What a cell did: its result, stdout, stderr, and the display messages it published."""

    result: ExecutionResult
    out: str
    err: str
    displays: list[dict[str, Any]]

    @property
    def error(self) -> BaseException | None:
        return self.result.error_in_exec or self.result.error_before_exec


@contextmanager
def open_shell() -> Iterator[InteractiveShell]:
    main = sys.modules["__main__"]
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbremote")
    try:
        yield shell
    finally:
        shell.run_line_magic("unload_ext", "nbremote")
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = main


def run(shell: InteractiveShell, code: str) -> Ran:
    with capture_output() as cap:
        result = shell.run_cell(code, store_history=True)
    displays = [{"data": o.data, "transient": o.transient, "update": o.update} for o in cap.outputs]
    return Ran(result, cap.stdout, cap.stderr, displays)
