"""Imported once by the fork server, so that every forked worker starts warm."""
from __future__ import annotations

from bamboo.node import forkserver

forkserver.mark_server()  # first: the server dies with its coordinator even mid-import

from bamboo.node import output  # noqa: E402 (after the server is marked)

output.stdout_to_stderr()  # never the launcher's stdout (its --json); workers log to files

import torch  # noqa: E402 (after the server is marked)

import bamboo.node.worker  # noqa: E402,F401  (the worker's whole import graph)

# Building an optimizer imports torch's compiler stack on first use; do it here once.
torch.optim.AdamW([torch.zeros(1, requires_grad=True)], foreach=False)
