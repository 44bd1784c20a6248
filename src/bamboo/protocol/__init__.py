"""What crosses a process boundary between the coordinator, its workers and its agents, and
imports no torch: the messages and store keys (`messages`), the authenticated frames of the
agents' sockets (`frames`), a step's votes and report (`votes`), and the run's modes as
types (`RedundancyMode`). A launcher of nodes (local processes, agents, and what comes next)
speaks only this package to the nodes it starts."""
from bamboo.config.modes import RedundancyMode

__all__ = ["RedundancyMode"]
