"""Test configuration: JAX on the CPU in float32, and hypothesis profiles.

Choose a hypothesis profile with the environment variable `JAXPAR_HYPOTHESIS_PROFILE`:

    JAXPAR_HYPOTHESIS_PROFILE=dev pytest tests/test_properties.py

- `ci` (default): derandomized, so every run tests the same programs and a failure
  reproduces; 20 examples per property (the feature families a fraction of that).
- `dev`: 20 random examples per property, for quick runs while editing.
- `thorough`: 1000 random examples per property, to hunt for bugs.

Sharp edges:
    `JAX_PLATFORMS` is set to `cpu` (unless already set) before anything imports JAX, so
    these tests never pick up an accelerator by accident; set it to run them elsewhere.
    64-bit mode stays off: the tests compare float32 programs.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=20,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=_SLOW_IS_FINE,
)
settings.register_profile(
    "dev", max_examples=20, deadline=None, suppress_health_check=_SLOW_IS_FINE
)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=_SLOW_IS_FINE
)
settings.load_profile(os.environ.get("JAXPAR_HYPOTHESIS_PROFILE", "ci"))
