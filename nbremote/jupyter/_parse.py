"""Parsing magic lines: pure functions from a line to a typed command, or a one-line usage error.

Every error says what was wrong and shows the right form (``USAGE``). The grammars are small and
positional (``start NAME...``; ``WORKER/DEVICE CLASS(ARGS)``), and argparse's messages name options
and metavars rather than the line the user typed, so the parsing is written out here; it needs no
kernel and is unit-tested with plain strings. ``%remote_module``'s class expression is parsed with
:mod:`ast` so its arguments can be evaluated one by one in the notebook's namespace.
"""

from __future__ import annotations

import ast
import shlex
from dataclasses import dataclass
from typing import Literal

from nbremote.nn import RemoteDevice, parse_remote_device

USAGE = {
    "remote_workers": ("%remote_workers  |  %remote_workers start NAME [NAME ...] [--kernel KERNELSPEC] "
                       "[--server URL|here [--token TOKEN] | --attach CONNECTION_FILE [--ssh USER@HOST] | "
                       "--slurm \"SBATCH OPTIONS\" [--packed]]  |  "
                       "%remote_workers stop|restart|interrupt NAME [NAME ...]  |  "
                       "%remote_workers group NAME [NAME ...] [--backend gloo|nccl]  |  "
                       "%remote_workers ungroup [NAME ...]"),
    "remote_module": ("net = %remote_module WORKER/DEVICE CLASS[(ARGS)]  (e.g. %remote_module worker1/cpu "
                      "MyNet(10, hidden=32))  |  %remote_module --reload NET"),
    "remote": "%%remote WORKER [WORKER ...] [--bg]",
}


class MagicUsageError(ValueError):
    """A magic line that does not parse; ``str()`` is the one line to show (problem, then usage)."""

    def __init__(self, magic: str, problem: str) -> None:
        super().__init__(f"{problem}. Usage: {USAGE[magic]}")
        self.magic = magic


def _strip_comment(line: str) -> str:
    """Drop a trailing ``# comment`` as a shell does: from a ``#`` that starts a word, outside quotes
    (``%remote_workers  # show them`` is the dashboard; ``--attach k#1.json`` keeps its ``#``)."""
    quote = None
    for i, char in enumerate(line):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _split(magic: str, line: str) -> list[str]:
    try:
        return shlex.split(_strip_comment(line))
    except ValueError as exc:  # an unclosed quote
        raise MagicUsageError(magic, f"cannot split {line.strip()!r} into words ({exc})") from None


# -- %remote_workers ----------------------------------------------------------------------------------------

WorkersAction = Literal["show", "start", "stop", "restart", "interrupt", "group", "ungroup"]
_OPTIONS = {"start": ("kernel", "attach", "ssh", "server", "token", "slurm", "packed"), "group": ("backend",)}
_FLAGS = frozenset({"packed"})  # options without a value


@dataclass(frozen=True)
class WorkersCommand:
    action: WorkersAction
    names: tuple[str, ...] = ()
    kernel: str | None = None
    attach: str | None = None
    ssh: str | None = None
    server: str | None = None  # a Jupyter server's URL, or "here": the one this notebook runs under
    token: str | None = None
    backend: str | None = None  # ``group``'s: the c10d backend (None: nccl where every member has CUDA, else gloo)
    slurm: str | None = None  # ``start``'s: sbatch options, a Slurm job per worker ("": the cluster's defaults)
    packed: bool = False  # ``start --slurm``'s: one job for all the workers named, a node and a job step each


def parse_workers(line: str) -> WorkersCommand:
    words = _split("remote_workers", line)
    if not words:
        return WorkersCommand("show")
    action, rest = words[0], words[1:]
    if action not in ("start", "stop", "restart", "interrupt", "group", "ungroup"):
        raise MagicUsageError("remote_workers", f"unknown action {action!r} (expected start, stop, restart, "
                                                "interrupt, group or ungroup, or nothing to show the dashboard)")
    names: list[str] = []
    options: dict[str, str] = {}
    while rest:
        word = rest.pop(0)
        if word.startswith("--"):
            option, _, value = word[2:].partition("=")
            if option not in _OPTIONS.get(action, ()):
                raise MagicUsageError("remote_workers", f"unknown option {word!r} for {action!r}")
            if option in _FLAGS:
                if value:
                    raise MagicUsageError("remote_workers", f"option --{option} takes no value")
                options[option] = "yes"
                continue
            if not value and option == "slurm" and rest and rest[0] == "--packed":  # not sbatch's: ours
                raise MagicUsageError("remote_workers", "option --slurm needs a value (its sbatch options in quotes, "
                                                        '"" for the cluster\'s defaults)')
            if not value and option == "slurm" and rest:  # its value is options: "--gres=gpu:1 -t 1:00:00"
                value = rest.pop(0)
                options[option] = value
                continue
            if not value:
                if not rest or rest[0].startswith("--"):
                    raise MagicUsageError("remote_workers", f"option --{option} needs a value")
                value = rest.pop(0)
            options[option] = value
        else:
            names.append(word)
    if not names and action != "ungroup":  # ``ungroup`` alone: every worker's group
        raise MagicUsageError("remote_workers", f"{action!r} needs at least one worker name")
    if "kernel" in options and "attach" in options:
        raise MagicUsageError("remote_workers", "--kernel starts a kernel and --attach uses a running one: pick one")
    if "ssh" in options and "attach" not in options:
        raise MagicUsageError("remote_workers", "--ssh reaches an attached kernel: give --attach CONNECTION_FILE too")
    if "server" in options and "attach" in options:
        raise MagicUsageError("remote_workers", "--server starts kernels in a Jupyter server and --attach uses a "
                                                "running one by its connection file: pick one")
    if "token" in options and "server" not in options:
        raise MagicUsageError("remote_workers", "--token is a Jupyter server's: give --server URL too")
    if "slurm" in options and options.keys() & {"kernel", "attach", "server"}:
        raise MagicUsageError("remote_workers", "--slurm starts each worker in a Slurm job: leave out --kernel, "
                                                "--attach and --server")
    if "packed" in options and "slurm" not in options:
        raise MagicUsageError("remote_workers", "--packed puts the workers in one Slurm job: give --slurm \"SBATCH "
                                                "OPTIONS\" too")
    if "attach" in options and len(names) > 1:
        raise MagicUsageError("remote_workers", "one connection file is one kernel: attach one worker at a time")
    return WorkersCommand(action, tuple(names), options.get("kernel"), options.get("attach"),  # type: ignore[arg-type]
                          options.get("ssh"), options.get("server"), options.get("token"), options.get("backend"),
                          options.get("slurm"), "packed" in options)


# -- %remote_module -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildCommand:
    """``place`` and the constructor expression's parts (``factory`` and its arguments, as AST nodes)."""

    place: RemoteDevice
    factory: ast.expr
    args: tuple[ast.expr, ...] = ()
    keywords: tuple[ast.keyword, ...] = ()


@dataclass(frozen=True)
class ReloadCommand:
    """``%remote_module --reload NAME``: ``name`` is the notebook variable holding the module."""

    name: str


def parse_module(line: str) -> BuildCommand | ReloadCommand:
    text = _strip_comment(line).strip()
    if not text:
        raise MagicUsageError("remote_module", "missing the worker and the class")
    head, _, rest = text.partition(" ")
    if head.startswith("--"):
        if head != "--reload":
            raise MagicUsageError("remote_module", f"unknown option {head!r}")
        name = rest.strip()
        if not name.isidentifier():
            raise MagicUsageError("remote_module", f"--reload needs the variable holding the module, got {name!r}")
        return ReloadCommand(name)
    try:
        place = parse_remote_device(head)
    except ValueError as exc:
        raise MagicUsageError("remote_module", str(exc).partition("; accepted forms")[0]) from None
    source = rest.strip()
    if not source:
        raise MagicUsageError("remote_module", f"missing the class to build on {head} after the worker")
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError as exc:
        raise MagicUsageError("remote_module", f"{source!r} is not a Python expression ({exc.msg})") from None
    if isinstance(node, ast.Call):
        return BuildCommand(place, node.func, tuple(node.args), tuple(node.keywords))
    return BuildCommand(place, node)


# -- %%remote ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellCommand:
    workers: tuple[str, ...]
    background: bool = False


def parse_cell(line: str) -> CellCommand:
    words = _split("remote", line)
    background = False
    workers: list[str] = []
    for word in words:
        if word in ("--bg", "--background"):
            background = True
        elif word.startswith("-"):
            raise MagicUsageError("remote", f"unknown option {word!r}")
        else:
            workers.append(word)
    if not workers:
        raise MagicUsageError("remote", "name at least one worker to run the cell on")
    if len(set(workers)) != len(workers):
        raise MagicUsageError("remote", f"a worker is named twice in {' '.join(workers)!r}")
    return CellCommand(tuple(workers), background)
