"""The worker process: one node of a run (`worker`), its device, CPU pinning, memory readings, the fork server that starts workers warm, and backend error classification."""

__all__: list[str] = []
