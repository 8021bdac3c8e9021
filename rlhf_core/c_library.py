"""The C library's functions this process already has loaded, for the host-memory settings.

`ctypes.CDLL(None)` reads the symbols of the running process (libc among them) without searching the
file system: `ctypes.util.find_library` would start `ldconfig -p` in a subprocess on every call.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def c_library() -> ctypes.CDLL | None:
    """This process's own symbols, with errno kept for `ctypes.get_errno`; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True)
