"""Unknown names refused with the closest valid one: every entry point that takes
options or argument names says ``(did you mean 'max_streams'?)`` the same way.

Example::

    check_known({"max_stream": 2}, ["max_streams", "target"])
    # TypeError: unknown jaxpar option(s) 'max_stream' (did you mean 'max_streams'?); ...
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'max_streams'?)`` for a misspelled name, or ``""``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known(given: Iterable[str], valid: Iterable[str], api: str = "jaxpar") -> None:
    """Raises ``TypeError`` for names in ``given`` that are not in ``valid``, suggesting the
    closest valid name; every entry point that takes options uses it.

    Raises:
      TypeError: an unknown name, e.g. ``unknown jaxpar option 'max_stream' (did you
        mean 'max_streams'?); valid options are: ...``.
    """
    valid = list(valid)
    unknown = sorted(set(given) - set(valid))
    if unknown:
        named = ", ".join(repr(name) + did_you_mean(name, valid) for name in unknown)
        raise TypeError(f"unknown {api} option(s) {named}; valid options are: "
                        f"{', '.join(valid)}")
