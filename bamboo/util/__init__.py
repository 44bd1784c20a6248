"""Small helpers every layer may use: strict JSON writing (`strict_json`). Imports nothing else of bamboo."""

__all__: list[str] = []
