"""What a call of a decorated function runs in Python.

``jaxpar_frames(call)`` runs ``call()`` under ``sys.setprofile`` and returns the Python
frames it entered whose code lies in the ``jaxpar`` package: empty when the call went
from the user's code straight into JAX's C++ dispatch.

Example::

    g(x)                                   # compiles
    assert jaxpar_frames(lambda: g(x)) == []
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import jaxpar

_PACKAGE = os.path.dirname(os.path.abspath(jaxpar.__file__)) + os.sep


def jaxpar_frames(call: Callable[[], Any]) -> list[str]:
    """``module:function`` of each Python frame of jaxpar's that ``call()`` entered."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            name = frame.f_code.co_filename[len(_PACKAGE):]
            seen.append(f"{name}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen
