"""Torch-free planning: schedules as instruction lists, partitions, layouts, role maps and failover plans, the planner of generations, placement, the timeline cost model, redundancy choice, fault plans and the votes the engine casts."""

__all__: list[str] = []
