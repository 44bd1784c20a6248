"""Training data: deterministic index-addressed datasets (`datasets`) and tokenized datasets on disk (`tokens`)."""

__all__: list[str] = []
