"""A gloo process group's options for the tests that build one by hand: loopback, and a
timeout short enough that a test fails rather than hangs."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def gloo_options(timeout_s: float = 15.0) -> dist.ProcessGroupGloo._Options:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return options
