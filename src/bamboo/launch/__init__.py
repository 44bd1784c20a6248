"""Where nodes run: the implementations of `bamboo.protocol.launch.Launcher` (local processes, agents on other machines, Ray actors)."""

__all__: list[str] = []
