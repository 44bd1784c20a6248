"""The links between processes of one run: a worker's line to the coordinator (its pipe and the store) and the store server they meet on; what they carry is `bamboo.protocol`."""

__all__: list[str] = []
