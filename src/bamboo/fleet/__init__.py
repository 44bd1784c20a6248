"""Many machines: the agent that runs workers on a machine, the coordinator's side of agents, etcd membership and preemption notices."""

__all__: list[str] = []
