"""Code the test modules share, one module a subject; read the one a test needs:

* ``environment``: what this run has and asks for: the one skip mark for tests that compile
  for a GPU without one (``needs_plugin``), ``JAXPAR_FULL`` and the hypothesis profiles.
* ``lowered``: reading lowered StableHLO and jaxpr text (stream calls, function bodies,
  a jaxpr's text with group ids renumbered) and ``lower_for_gpu``.
* ``trees``: comparing results (bit-exact, close, or as a target's regions allow).
* ``programs``: the small hand-written programs the tests share, with their arguments and
  the options that make them stream.
* ``calls``: the Python frames of jaxpar's a call enters (none once compiled).
* ``benchmarks``: the scripts of ``benchmarks/`` loaded as modules, their deviceless GPU
  compiles once a session, and a calibrated GPU profile.

Example::

    from helpers.lowered import lower_for_gpu, stream_calls
    from helpers.programs import FOUR_BRANCHES_OPTIONS, four_branches, four_branches_args

    g = jaxpar.parallel_branches(four_branches, **FOUR_BRANCHES_OPTIONS)
    calls = stream_calls(lower_for_gpu(g, *four_branches_args()))
    [attrs["_xla_stream_annotation"] for _, attrs in calls]   # ["1", "2"]

The test modules share code only through this package, ``pass_checker.py`` and
``programs.py`` (the random-program strategies); a test module imports no other.
"""
