"""Reconfiguration: moving a running job onto a new set of nodes at a step boundary."""
