"""The report: the public ``Plan`` and everything that builds or draws it.

From the bottom: ``types`` (the parts of a plan and its one figure), ``timeline``
(when each step runs), ``render`` (SVG, HTML, Chrome trace, dot), ``plan`` (the public
``Plan``: its text, pictures and estimate), ``build`` (the planner's tree -> ``Plan``).
"""
