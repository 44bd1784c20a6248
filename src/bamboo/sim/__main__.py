"""``python -m bamboo.sim``: the same as ``bamboo simulate``, through the command's own
entry (`python -m bamboo`), so that nothing in `bamboo.sim` depends on the command layer."""

import runpy
import sys

sys.argv = ["bamboo", "simulate", *sys.argv[1:]]
runpy.run_module("bamboo", run_name="__main__", alter_sys=True)
