"""``python -m bamboo.sim``: the same as ``bamboo simulate``."""

import sys

from .cli import main

sys.exit(main())
