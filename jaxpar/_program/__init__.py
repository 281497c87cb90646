"""Reading jaxprs: what the passes, the planner and the cost model ask of a program.

``primitives`` (every family of primitive names), ``structure`` (structural keys),
``loops`` (static trip counts of whiles), ``interp`` (the environment an interpreter binds
values in), ``graph`` (the dependency graph of one level). Import the submodules; this
package imports nothing, so reading one module does not load the others.
"""
