"""numpy adapter: keep non-contiguous arrays out of band too.

numpy's own ``__reduce_ex__(5)`` already ships C- or Fortran-contiguous arrays as one out-of-band
``PickleBuffer`` and rebuilds them aliasing the received buffer, so those are left to it. A
non-contiguous array (``a[::2]``, ``a.T[1:]``) would instead be copied *into* the pickle stream; here it is
packed once into a contiguous copy, which then travels out of band like any other array (it arrives
C-contiguous, as with numpy's own pickling). Arrays rebuilt from read-only ``bytes`` frames are
read-only, exactly as numpy does it; the transport hands over writable frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nbremote.frameworks import Reducer

__all__ = ["reduce_array", "reducers"]

# Below this size the in-band copy numpy makes is cheaper than a separate frame.
_OUT_OF_BAND_MIN = 1024


def reduce_array(a: np.ndarray[Any, Any]) -> Any:
    """Reduce a non-contiguous plain array to a contiguous copy; anything else is left to numpy."""
    if a.flags.c_contiguous or a.flags.f_contiguous or a.dtype.hasobject or a.nbytes < _OUT_OF_BAND_MIN:
        return NotImplemented
    # np.ascontiguousarray is importable by reference; given an already contiguous array it returns it.
    return np.ascontiguousarray, (np.ascontiguousarray(a),)


def reducers() -> dict[type, Reducer]:
    return {np.ndarray: reduce_array}
