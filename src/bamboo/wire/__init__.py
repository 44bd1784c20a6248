"""The message layer between processes: protocol messages, length-prefixed authenticated frames, and the links that carry them."""

__all__: list[str] = []
