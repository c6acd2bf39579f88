"""Where the kernels nbremote starts keep their files: private directories for connection files (a kernel's
key) and logs (its output), and the sweep of connection files whose driver died."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["log_dir", "open_private", "private_dir", "runtime_dir", "sweep_connection_files"]

_fallback_dirs: dict[str, Path] = {}


def private_dir(path: Path, purpose: str) -> Path:
    """``path`` made if missing (0700); if it is not ours alone (another owner, or open to others -- e.g.
    made in /tmp by someone else first), a fresh private directory of this process instead: connection
    files hold a kernel's key and logs hold its output."""
    with contextlib.suppress(OSError):
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return path
    if purpose not in _fallback_dirs:
        _fallback_dirs[purpose] = Path(tempfile.mkdtemp(prefix=f"nbremote-{purpose}-"))  # 0700 by mkdtemp
    return _fallback_dirs[purpose]


def log_dir() -> Path:
    path = Path(os.environ.get("NBREMOTE_LOG_DIR") or Path(tempfile.gettempdir()) / f"nbremote-{os.getuid()}")
    return private_dir(path, "logs")


def runtime_dir() -> Path:
    """Where the connection files of the kernels nbremote starts go: Jupyter's runtime directory (private,
    and where ``jupyter console --existing`` looks), not jupyter_client's default of a file in /tmp."""
    from jupyter_core.paths import jupyter_runtime_dir

    return private_dir(Path(jupyter_runtime_dir()), "runtime")


# A connection file, or one of the Unix sockets of a kernel on the ipc transport ("<name>.ipc-<port>")
_CONN_FILE = re.compile(r"^kernel-nbremote-.+-(\d+)-[0-9a-f]{8}\.(json|ipc-\d+)$")


def sweep_connection_files() -> int:
    """Remove the connection files (and ipc sockets) of kernels whose driver died without stopping them
    (SIGKILL): their kernels died with it, and their keys need not stay on disk. The driver's pid is in each
    name; a file whose pid is alive (that driver, or a process that reused its pid) is left alone. Returns
    how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for path in runtime_dir().iterdir():
            match = _CONN_FILE.match(path.name)
            if match is None:
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def open_private(path: Path) -> Any:
    """Open ``path`` for appending, readable by its owner only (0600), also if it existed already."""
    # open() with an opener, not os.fdopen: the file keeps its path as .name (the zygote reopens it by name)
    f = open(path, "ab", opener=lambda p, flags: os.open(p, flags, 0o600))  # noqa: SIM115 -- the caller closes it
    with contextlib.suppress(OSError):
        os.fchmod(f.fileno(), 0o600)
    return f
