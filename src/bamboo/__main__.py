"""`python -m bamboo`: the same as the `bamboo` command."""
import sys

from bamboo.cli import main

sys.exit(main())
