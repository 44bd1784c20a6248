"""Which runs keep the failure-free run's parameter bits: the contract's rule, in one place.

Every run ends with losses within `LOSS_REL` relative and `param_l2` within `L2_REL` of the
failure-free run of the same seed, steps and global batch. `param_sha256` is equal too:

- always under `--exact` (float64 sums in pipeline order make every layout bit-identical);
- in fp32 when every committed step ran the first step's layout, D x P (which fixes the
  micro-batches per pipeline) with no slot re-routed: a shadow's failover, a drain and a
  restore that keep it sum in the same order.

A change of D or P, or a re-routed slot (its stage's gradients summed by the peers that
served it, in another order), may change the fp32 bits: then the tolerances above judge.
A summary records the layouts its committed steps ran (`layouts`: one entry per change,
`{"from_step", "pipelines", "stages", "rerouted"}`); `bamboo soak` and the tests judge by
`bits_must_match` and `differs`; `bamboo.same` (`bamboo.run.sameness`) by the same rule.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["LOSS_REL", "L2_REL", "COUNTERS", "bits_must_match", "differs", "explain",
           "loss_within", "l2_within", "counted"]

LOSS_REL, L2_REL = 1e-5, 1e-6
COUNTERS = ("failovers", "drains", "peer_restores", "checkpoint_restores", "standby_losses",
            "stopped", "reroutes")
"""The summary's counters of lost nodes: they sum to `preemptions`."""


def _shape(layout: Mapping[str, Any]) -> tuple[Any, Any]:
    return layout.get("pipelines"), layout.get("stages")


def bits_must_match(summary: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> bool:
    """Whether the run of `summary` must end with the failure-free run's `param_sha256`
    (`base`: that run's summary, whose first layout every step must have kept)."""
    if (summary.get("config") or {}).get("exact"):
        return True
    layouts = summary.get("layouts")
    if not isinstance(layouts, list) or not layouts:  # a summary written before the record
        return not summary.get("reconfigurations") and not summary.get("reroutes")
    first = (base or {}).get("layouts") or layouts
    shape = _shape(first[0])
    return all(_shape(x) == shape and not x.get("rerouted") for x in layouts)


def loss_within(got: Any, want: float) -> bool:
    """Whether the loss `got` is within `LOSS_REL` relative of `want` (and a finite number)."""
    return isinstance(got, (int, float)) and isinstance(want, (int, float)) and \
        math.isfinite(got) and abs(got - want) <= LOSS_REL * abs(want)


def l2_within(got: Any, want: Any) -> bool:
    """Whether the parameters' L2 norm `got` is within `L2_REL` relative of `want`."""
    return got is not None and want is not None and abs(got - want) <= L2_REL * abs(want)


def counted(summary: Mapping[str, Any]) -> int:
    """The sum of the summary's counters of lost nodes (its `preemptions` must equal it)."""
    return sum(summary.get(k, 0) for k in COUNTERS)


def differs(base: Mapping[str, Any], got: Mapping[str, Any]) -> str:
    """Why the summary `got` breaks the contract against the failure-free `base` ('' when
    it keeps it): its losses, `param_l2`, its bits where `bits_must_match`, its counters."""
    losses, want = got.get("losses") or [], base.get("losses") or []
    if len(losses) != len(want):
        return f"{len(losses)} losses, the failure-free run has {len(want)}"
    for k, (a, b) in enumerate(zip(losses, want)):
        if not loss_within(a, b):
            return f"the loss of step {k} is {a!r}, failure-free {b!r}"
    a, b = got.get("param_l2"), base.get("param_l2")
    if not l2_within(a, b):
        return f"param_l2 {a!r}, failure-free {b!r}"
    if bits_must_match(got, base) and got.get("param_sha256") != base.get("param_sha256"):
        return ("param_sha256 differs although every step kept the layout and the order of "
                "its sums" + (" (--exact)" if (got.get("config") or {}).get("exact") else ""))
    if got.get("preemptions") != counted(got):
        return f"preemptions {got.get('preemptions')} but the counters sum to {counted(got)}"
    return ""


def explain(base: Mapping[str, Any], got: Mapping[str, Any]) -> str:
    """Why a run that keeps the contract (`differs` is '') is equal, in one line: how its
    losses were handled, which rule judged its bits, and how close it came."""
    handled = ", ".join(f"{k} {got[k]}" for k in COUNTERS if got.get(k)) or "no loss"
    rel = max((abs(a - b) / abs(b) for a, b in zip(got.get("losses") or [],
                                                    base.get("losses") or []) if b), default=0.0)
    same = got.get("param_sha256") == base.get("param_sha256")
    if bits_must_match(got, base):
        rule = "bits equal, as required" + (" (--exact)" if (got.get("config") or {})
                                              .get("exact") else " (the layout was kept)")
    else:
        rule = ("bits " + ("equal" if same else "differ") + ", allowed: the layout changed or "
                "a slot was re-routed, so the tolerances judge")
    return f"{handled}; {rule}; losses within {rel:.1e} relative"
