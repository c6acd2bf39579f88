"""Floor 3 of ``nbremote.rpc``, beside ``_kernels``: what every member of the world runs, driver and workers alike.

``agent`` ties it together: one ``Agent`` per process, which makes calls (``future``), serves them
(``serving``, on the ``pool``'s threads, with their output captured by ``capture``), owns values for RRefs
(``owners``; the user side is ``rref``) and records what distributed autograd needs (``gradctx``);
``oneway`` sends what wants no reply, ``current`` holds this process's one member, ``members`` says who is
in the world, ``resources`` what a member reports about itself, ``tasks`` what it ran lately (the
dashboard's task stream). It builds on ``_transport`` and ``_wire``.

What the packages above the RPC layer (``nbremote.autograd``, ``optim``, ``nn``) use of it is exported
here; they import nothing else of ``nbremote.rpc`` but its public facade.
"""

from nbremote.rpc._core import gradctx, oneway, tasks
from nbremote.rpc._core.agent import DEFAULT_TIMEOUT, Agent, current_agent
from nbremote.rpc._core.calls import introspection
from nbremote.rpc._core.future import Future, settle_all, wait_all
from nbremote.rpc._core.owners import incarnation_of
from nbremote.rpc._core.rref import RRef, adopt, held_reference, owned_value

__all__ = ["DEFAULT_TIMEOUT", "Agent", "Future", "RRef", "adopt", "current_agent", "gradctx", "held_reference",
           "incarnation_of", "introspection", "oneway", "owned_value", "settle_all", "tasks", "wait_all"]
