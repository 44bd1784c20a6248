"""Small helpers every layer may use: strict JSON writing (`strict_json`), the log's lines
(`logs`). Imports nothing else of bamboo."""

__all__: list[str] = []
