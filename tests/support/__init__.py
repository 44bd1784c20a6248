"""Helpers shared by the test tiers: `from support.runs import run_in_process`.

procs: running the `bamboo` command and reading its run directory; strict: the strict-JSON
check of run files; runs: in-process runs and their comparison with the failure-free
reference; reference: the plain single-process training loop; processes: watching and
killing process trees; agents: a coordinator and agents on loopback; servers: etcd and
cloud metadata endpoints on loopback."""
