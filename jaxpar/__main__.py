"""``python -m jaxpar``: see ``jaxpar._cli``."""

from ._cli import main

raise SystemExit(main())
