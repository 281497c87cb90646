"""``unroll_scans``' import of the loop-candidate helpers, until it imports them from
``_loop_candidates`` (where they live); nothing else may import from here.
"""

from ._loop_candidates import MAX_UNROLLED_EQNS as MAX_UNROLLED_EQNS
from ._loop_candidates import loop_candidates as loop_candidates
from ._loop_candidates import loop_trips as loop_trips
