"""``rpc.functions.async_execution``: a remote function that returns a Future instead of a value.

As in torch: decorate a function that returns an ``nbremote.rpc.Future`` (or a ``torch.futures.Future``);
when it runs as an RPC the reply is sent once that future completes, and the worker's thread is free in the
meantime (so one worker can hold thousands of such calls, e.g. batching requests or waiting on other
workers). As torch's, the reply leaves from the thread that completes the future -- the serving thread when
it is done on return, the thread that calls ``set_result`` otherwise -- so such a call costs what a plain one
does (see ``_core.serving``). Functions marked with torch's own decorator are honoured too.
"""

from __future__ import annotations

from nbremote.rpc._core.serving import async_execution

__all__ = ["async_execution"]
