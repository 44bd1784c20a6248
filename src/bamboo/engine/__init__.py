"""One node's pipeline engine: the dispatcher of its instruction list, stages, point-to-point transport, in-flight failover, the commit round, split backward, memory, evaluation and the optimizer."""

__all__: list[str] = []
