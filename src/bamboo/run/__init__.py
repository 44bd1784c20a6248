"""A run on disk: the run directory (events, summary, model), checkpoints, the report and its plots, export and the progress display."""

__all__: list[str] = []
