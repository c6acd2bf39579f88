"""What a Slurm job script of ``SlurmKernel`` is made of, a job per worker or packed alike.

``opening``: the script's first lines (who wrote it, the notebook kernel's ``JPY_PARENT_PID`` unset, the spec's
``env`` exported, its ``setup``); ``worker_command``: the ``nbremote worker`` a job (or step) runs;
``file_name``: a worker's name as a file name, one to one (``a:b`` and ``a_b`` never share a file), without
Slurm's ``%``; ``write_private``: a file only this user reads (scripts and requests that sit beside connection
files, which hold the kernels' keys); ``JOB_SCRIPT``, ``JOB_LOG``, ``KERNEL_FILE``: a start's files in its
private directory, named here once for the start and the stop alike.
"""

from __future__ import annotations

import getpass
import os
import shlex
import socket
from pathlib import Path
from urllib.parse import quote

__all__ = ["JOB_LOG", "JOB_SCRIPT", "KERNEL_FILE", "file_name", "opening", "worker_command", "write_private"]

JOB_SCRIPT = "job.sh"  # the job script of a start (a job per worker, or a pack's), in its directory
JOB_LOG = "job.log"  # that job's own output (sbatch --output)
KERNEL_FILE = "kernel.json"  # a job per worker: its worker's connection file (a pack's members have their own)


def file_name(name: str) -> str:
    """Worker ``name`` as a file name, so that two names are never one file: percent-encoded with ``+`` for ``%``
    (``a:b`` is ``a+3Ab``, ``a/b`` is ``a+2Fb``, ``+`` is ``+2B``). Not ``%``: Slurm reads ``%A`` and the like in
    ``--output`` as its own (``%3A``: the array job's id)."""
    return quote(name, safe="").replace("%", "+")  # one to one: quote encodes every "+", so each one here was a "%"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only (0600 from its creation on)."""
    with open(path, "w", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
        f.write(text)


def opening(what: str, env: dict[str, str], setup: str) -> list[str]:
    """A job script's first lines: its shebang, a comment naming ``what`` it runs and for whom, ``env`` exported,
    then ``setup``."""
    return ["#!/bin/bash",
            f"# {what} for {getpass.getuser()}@{socket.gethostname()} (pid {os.getpid()}), written by "
            "nbremote.SlurmKernel",
            # a notebook kernel's own: ipykernel in the job would watch a pid of the login node and exit
            "unset JPY_PARENT_PID",
            *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
            setup]


def worker_command(python: str, conn_file: Path, driver: str) -> str:
    """The shell command of a worker's kernel: ``nbremote worker`` on the node's address on its route to
    ``driver``, writing ``conn_file``."""
    return (f"{shlex.quote(python)} -m nbremote.cli worker --connection-file {shlex.quote(str(conn_file))} "
            f"--ip auto --driver {shlex.quote(driver)}")
