"""The pipeline: partitions, schedules as data, and the engine that dispatches them."""
