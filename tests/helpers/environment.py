"""What this run has and asks for: the CUDA plugin's skip mark, ``JAXPAR_FULL`` and the
hypothesis profiles (``tests/conftest.py`` registers them).

Example::

    from helpers.environment import needs_plugin

    @needs_plugin
    def test_compiles_for_an_h200() -> None: ...

Sharp edges:
    ``needs_plugin`` is the one mark for tests that compile for a GPU without one
    (``tests/test_architecture.py`` checks that no test module builds its own).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from jaxpar._compiled import plugin_status

# Tests that compile for a GPU without one need the CUDA PJRT plugin at jaxlib's exact
# version: one skip mark for all of them, whose reason says how to install it.
PLUGIN_OK, PLUGIN_MESSAGE = plugin_status()
if not PLUGIN_OK and os.environ.get("JAXPAR_PLUGIN_LEFT_OUT"):
    # scripts/test.sh's jax 0.12 lane: the deviceless GPU compiles run in the other lane.
    PLUGIN_MESSAGE = ("this lane leaves the CUDA plugin out on purpose; the deviceless GPU "
                      "compiles run in scripts/test.sh's jax 0.10.2 lane")
needs_plugin = pytest.mark.skipif(not PLUGIN_OK, reason=PLUGIN_MESSAGE)

# The benchmark scripts run end to end in a subprocess (``tests/test_benchmarks.py``): in
# scripts/test.sh's jax 0.10.2 lane only (the TPU machine's jax), which sets nothing; the
# jax 0.12 lane sets JAXPAR_SCRIPTS_ELSEWHERE=1 (the lanes' time, docs/benchmarks.md). Run
# alone, they run whatever the jax.
runs_scripts = pytest.mark.skipif(
    os.environ.get("JAXPAR_SCRIPTS_ELSEWHERE", "") == "1",
    reason="the benchmark scripts' end-to-end runs are in scripts/test.sh's jax 0.10.2 lane "
           "(the TPU machine's jax); run this file alone to run them here")

# `JAXPAR_FULL=1`: the full matrices, where the default run samples them (see conftest.py).
FULL = os.environ.get("JAXPAR_FULL", "0") not in ("", "0")


def hypothesis_profile() -> str:
    """The hypothesis profile of this run: `JAXPAR_HYPOTHESIS_PROFILE`, else `full` under
    `JAXPAR_FULL=1`, else `ci` (tests/conftest.py registers them)."""
    return os.environ.get("JAXPAR_HYPOTHESIS_PROFILE") or ("full" if FULL else "ci")


def fraction_of_examples(fraction: float) -> Any:
    """Hypothesis settings for a fraction of the profile's examples (at least 4); in the
    derandomized `ci` and `full` profiles without shrinking, so that a failure is reported
    at once (run the `thorough` profile to shrink it). For properties whose programs
    compile more than the others."""
    from hypothesis import Phase, settings

    no_shrink = hypothesis_profile() in ("ci", "full")
    phases = tuple(p for p in Phase if p is not Phase.shrink) if no_shrink else tuple(Phase)
    return settings(max_examples=max(4, int(settings().max_examples * fraction)),
                    phases=phases)
