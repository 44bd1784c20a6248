"""Faults on purpose: soaks of random kills judged against the failure-free run (`soak`, `bits`) and the network-namespace lab of real hosts (`lab`)."""

__all__: list[str] = []
