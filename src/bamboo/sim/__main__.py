"""``python -m bamboo.sim``: the same as ``bamboo simulate`` (an entry point, not part of the
library: the one module of `bamboo.sim` that imports the command layer above it, as
`.importlinter` records)."""

import sys

from bamboo.cli.simulate import main

sys.exit(main())
