"""The tutorials around the notebooks: what nbval does not check by running them.

nbval (see ``notebooks/conftest.py``) runs every notebook and compares its checked cells. These tests
check the rest: the saved notebooks are clean and end with a shutdown, every one is linked from the
README, the README's magics example runs in a fresh kernel as a new user would run it, Binder's files
install what the notebooks import, and ``panel_for`` (which the notebooks use to click the panel from
code) is the panel a module displays.
"""

from __future__ import annotations

import ast

import pytest

pytestmark = pytest.mark.timeout(120)


def test_magic_lines_may_end_with_a_comment() -> None:
    """As in the README's example: a ``# comment`` after a magic's arguments is a comment, not an argument."""
    from nbremote.jupyter._parse import ReloadCommand, parse_cell, parse_module, parse_workers

    assert parse_workers("  # the dashboard").action == "show"
    assert parse_workers("start w1 w2  # two of them").names == ("w1", "w2")
    assert parse_workers("start w1 --attach k#1.json").attach == "k#1.json"  # '#' inside a word stays
    assert parse_workers("start w1 --attach 'a #b.json'").attach == "a #b.json"  # and inside quotes
    assert parse_cell("worker1 --bg  # later").background is True
    assert parse_module("--reload net  # keep the weights") == ReloadCommand("net")
    built = parse_module("worker1/cpu Net(8, name='a #b')  # build it")
    assert not isinstance(built, ReloadCommand) and ast.literal_eval(built.keywords[0].value) == "a #b"
