"""Planning: which equations run together on which CUDA stream.

The planner is a sequence of phases (numbered as in docs/design.md, "Planning"), one
module each, every one returning a frozen value that can be tested alone:

* ``plans``: the results (``LevelPlan``, ``SectionPlan``, ``RegionPlan``, ``Note``)
  and the reasons and primitive families they use.
* ``heavy`` (phase 1): which equations of a window are heavy, their ancestor/descendant bit
  masks, and cheap loose ends attached into units (``HeavyOrder``).
* ``sections`` (phases 2 and 3): the series-parallel tree over units and the dynamic programme that
  chooses sections (``SPNode``, ``choose_sections``).
* ``regions`` (phase 4): hull, longest-first balance onto streams, private producers and
  consumers (``RegionSet``).
* ``pricing`` (phase 5): the GPU pricing of a candidate section (``price_regions``).
* ``collectives``: groups of collectives launched together, and the compute that
  overlaps each group (in place of phases 2 to 4 where a level has such groups).
* ``level``: ``plan_jaxpr`` runs the phases for one level, writes the notes, orders and
  checks the units (``order_units``, phase 6) and recurses into nested jaxprs (phase 7).

Two modules decide for a whole function, in the pipeline's stages (``_pipeline``)
rather than per level: ``budget`` (stages 2 and 3) and ``modes`` (stage 4), which compares
the programs' times in each mode as ``gpu_time`` estimates them.

Example::

    level = plan_jaxpr(closed_jaxpr, Analysis(Options().resolve("gpu")))
    for section in level.sections: ...
"""

from .collectives import (
    COLLECTIVES_GROUP_ATTRIBUTES as COLLECTIVES_GROUP_ATTRIBUTES,
)
from .collectives import group_collectives as group_collectives
from .level import order_units as order_units
from .level import plan_jaxpr as plan_jaxpr
from .level import symbolic_plan as symbolic_plan
from .plans import COLLECTIVE_PRIMITIVES as COLLECTIVE_PRIMITIVES
from .plans import MAX_HEAVY as MAX_HEAVY
from .plans import REASON_ANNOTATED as REASON_ANNOTATED
from .plans import REASON_COLLECTIVE as REASON_COLLECTIVE
from .plans import REASON_DEPENDENT as REASON_DEPENDENT
from .plans import REASON_EFFECTFUL as REASON_EFFECTFUL
from .plans import REASON_NO_GAIN as REASON_NO_GAIN
from .plans import REASON_OPAQUE as REASON_OPAQUE
from .plans import REASON_SYMBOLIC as REASON_SYMBOLIC
from .plans import REASON_TOO_CHEAP as REASON_TOO_CHEAP
from .plans import RECURSIVE_PRIMITIVES as RECURSIVE_PRIMITIVES
from .plans import CollectiveGroup as CollectiveGroup
from .plans import CollectiveInfo as CollectiveInfo
from .plans import CollectivePlan as CollectivePlan
from .plans import LevelPlan as LevelPlan
from .plans import Note as Note
from .plans import RegionPlan as RegionPlan
from .plans import SectionPlan as SectionPlan
