"""Bamboo against the systems a user would pick instead, on one job and one set of
preemptions: torchrun elastic DDP with DCP checkpoint restarts, and torchft replica groups
(`python -m benchmarks.peers.run --help`)."""
