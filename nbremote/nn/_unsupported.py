"""The ``nn.Module`` methods a RemoteModule refuses, each with the hint a user can act on.

The module lives on a worker, so methods that would need it here (moving it, converting its dtype,
hooks, iterating its parameters or submodules, its ``state_dict``) raise ``ValueError`` naming the
method and the worker, plus the explicit remote counterpart where one exists (``remote_to``,
``remote_state_dict``, ``remote_parameters``). :data:`UNSUPPORTED` maps each name to that hint; the
refusing methods are closures made by :func:`unsupported`, one per name, installed on RemoteModule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["UNSUPPORTED", "unsupported"]


def unsupported(name: str, hint: str = "") -> Callable[..., Any]:
    """A method that refuses: the module lives on a worker, so ``name`` cannot act on it here."""

    torch_words = f". {_TORCH_HINTS[name]}" if name in _TORCH_HINTS else ""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        suffix = f"; {hint}" if hint else ""
        raise ValueError(  # torch's words first
            f"Method ``{name}`` not supported for RemoteModule{torch_words}: the module lives on worker "
            f"{self.__dict__.get('on', '?')!r}{suffix}"
        )

    refuse.__name__ = name
    refuse.__qualname__ = f"RemoteModule.{name}"
    refuse.__doc__ = f"Not supported on a RemoteModule (raises ValueError){': ' + hint if hint else '.'}"
    return refuse


_TORCH_HINTS = {"parameters": "Please use ``remote_parameters`` instead"}  # torch's own, where it gives one
_MOVE = "move the remote module with remote_to(device)"
_DTYPE = "build the module with the dtype you need on the worker (e.g. pass dtype in kwargs)"
_HOOK = "hooks must be registered on the worker that owns the module"
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(["to", "cuda", "cpu", "ipu", "xpu", "mtia", "to_empty"], _MOVE),
    **dict.fromkeys(["type", "half", "float", "double", "bfloat16"], _DTYPE),
    **dict.fromkeys(
        [
            "register_forward_hook",
            "register_forward_pre_hook",
            "register_backward_hook",
            "register_full_backward_hook",
            "register_full_backward_pre_hook",
            "register_state_dict_pre_hook",
            "register_state_dict_post_hook",
            "register_load_state_dict_pre_hook",
            "register_load_state_dict_post_hook",
        ],
        _HOOK,
    ),
    "apply": "run code on the owner with rpc.rpc_sync(rm.on, fn, args=(rm.get_module_rref(),))",
    "register_buffer": "",
    "register_parameter": "",
    "add_module": "",
    "register_module": "",
    "get_submodule": "",
    "set_submodule": "",
    "get_parameter": "use remote_parameters()",
    "get_buffer": "use remote_state_dict()",
    "get_extra_state": "",
    "set_extra_state": "",
    "state_dict": "use remote_state_dict() to fetch a CPU copy",
    "load_state_dict": "use remote_load_state_dict(state_dict)",
    "parameters": "remote_parameters() gives RRefs to them",
    "named_parameters": "use remote_parameters() (RRefs) or remote_state_dict() (named copies)",
    "buffers": "use remote_state_dict()",
    "named_buffers": "use remote_state_dict()",
    "children": "",
    "named_children": "",
    "modules": "",
    "requires_grad_": "",
    "zero_grad": "gradients live on the worker (see nbremote.autograd)",
    "share_memory": "",
    "extra_repr": "",
    "compile": "",
}
