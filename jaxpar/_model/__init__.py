"""The cost models: what running a program would take, without running it.

``gpu`` (the one GPU model: each GPU kind's figures, CommandBufferMode), ``gpu_simulator``
(the one GPU simulator), ``cost`` (per-equation cost), ``gpu_levels`` (a jaxpr's levels
timed in a CUDA-graph mode), ``memory`` (temporary bytes as XLA:GPU allocates them).
Import the submodules; this package imports nothing, so reading one module does not load
the others.
"""
