"""Whether two runs ended the same under the contract's rule (`bamboo.run.bits`), and why.

    verdict = compare(summary_a, summary_b)
    bool(verdict), verdict.reason   # True, "bit-equal: the same losses and parameter bits"

Two runs of one job (the same model, data, seed, steps, global batch and optimizer) are the
same when both completed, their losses are within `LOSS_REL` relative and their `param_l2`
within `L2_REL` of the first run's, and their `param_sha256` is equal wherever the rule
requires it: under `exact` in both, or in fp32 when both ran one D x P at every step with no
slot re-routed (a failover or a drain that keeps the layout keeps the bits). Held-out
losses and metrics are judged like the losses. Each run's `preemptions` must equal the sum
of its counters. `bamboo.same` and `RunResult.matches` answer with this; `bamboo soak`
judges its trials by the same rule (`bits.differs`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bamboo.run.bits import L2_REL, LOSS_REL, bits_must_match, counted, l2_within, loss_within

__all__ = ["Verdict", "compare", "JOB_KEYS"]

JOB_KEYS = ("model", "data", "dataset", "seed", "steps", "global_batch_size", "micro_batch_size",
            "lr", "warmup_steps", "weight_decay", "grad_clip", "optimizer", "lr_schedule", "loss",
            "precision")
"""The `config` keys that make two runs one job: the rule compares only runs equal in these
(a key missing from either summary is not compared)."""

Summary = Mapping[str, Any]
_WHO = ("the first run", "the second run")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether two runs are the same under the contract's rule: truthy when they are.
    `reason` says why in one line: how equal they are, or what differs and by how much."""

    equal: bool
    reason: str
    bits_equal: bool | None = None
    """Whether the two `param_sha256` are equal (None when not compared)."""
    loss_rel: float | None = None
    """The largest relative difference of two losses of one step (None when not compared)."""

    def __bool__(self) -> bool:
        return self.equal

    def __str__(self) -> str:
        return ("same: " if self.equal else "different: ") + self.reason


def compare(a: Summary, b: Summary) -> Verdict:
    """The verdict on two runs' summaries (summary.json as a dict); the tolerances are
    relative to `a`'s values (the failure-free run, where one of the two is)."""
    checks: tuple[Callable[[], str], ...] = (
        lambda: _unfinished(a, b), lambda: _other_job(a, b), lambda: _losses(a, b),
        lambda: _l2(a, b), lambda: _series(a, b), lambda: _counters(a, b))
    rel = _largest_loss_rel(a, b)
    for check in checks:
        problem = check()
        if problem:
            return Verdict(False, problem, None, rel)
    bits_equal = a.get("param_sha256") == b.get("param_sha256")
    if bits_required(a, b) and not bits_equal:
        return Verdict(False, f"param_sha256 differs although {_why_bits_kept(a)}, which keeps "
                              f"the bits (losses within {rel:.1e} relative)", False, rel)
    return Verdict(True, _equal_reason(a, b, bits_equal, rel), bits_equal, rel)


def bits_required(a: Summary, b: Summary) -> bool:
    """Whether the rule requires the two runs' bits equal: `exact` in both, or neither
    exact and each run's every step on the other's first layout with no slot re-routed."""
    exact = [bool((s.get("config") or {}).get("exact")) for s in (a, b)]
    if exact[0] != exact[1]:
        return False
    return bits_must_match(a, b) and bits_must_match(b, a)


def _equal_reason(a: Summary, b: Summary, bits_equal: bool, rel: float) -> str:
    if bits_equal and a.get("losses") == b.get("losses"):
        return "bit-equal: the same losses and parameter bits"
    if bits_equal:
        return f"parameters bit-equal, losses within {rel:.1e} relative (at most {LOSS_REL:g})"
    l2a, l2b = a.get("param_l2"), b.get("param_l2")
    l2_rel = abs(l2a - l2b) / abs(l2a) if l2a else 0.0
    why = _why_bits_may_differ(a, b)
    return (f"losses within {LOSS_REL:g} and param_l2 within {L2_REL:g} ({why}); measured "
            f"{rel:.1e} and {l2_rel:.1e}")


def _why_bits_kept(a: Summary) -> str:
    if (a.get("config") or {}).get("exact"):
        return "both ran with exact=True"
    shape = (a.get("layouts") or [{}])[0]
    return (f"both kept one layout ({shape.get('pipelines')} pipelines x {shape.get('stages')} "
            f"stages) and the order of their sums" if shape else "neither changed its layout")


def _why_bits_may_differ(a: Summary, b: Summary) -> str:
    exact = [bool((s.get("config") or {}).get("exact")) for s in (a, b)]
    if exact[0] != exact[1]:
        return "one run exact, the other not: the bits may differ"
    layouts = [x for s in (a, b) for x in s.get("layouts") or []]
    if any(x.get("rerouted") for x in layouts):
        return "a slot was re-routed: the bits may differ"
    return "the layout changed: the bits may differ"


def _unfinished(a: Summary, b: Summary) -> str:
    for who, s in zip(_WHO, (a, b)):
        if s.get("status") != "completed":
            error = f": {s.get('error')}" if s.get("error") else ""
            return f"{who} did not complete (status {s.get('status')!r}{error})"
    return ""


def _other_job(a: Summary, b: Summary) -> str:
    ca, cb = a.get("config") or {}, b.get("config") or {}
    other = [k for k in JOB_KEYS if k in ca and k in cb and ca[k] != cb[k]]
    if not other:
        return ""
    shown = "; ".join(f"{k} {ca[k]!r} and {cb[k]!r}" for k in other[:3])
    return (f"not the same job ({shown}): the rule compares runs of one model, data, seed, "
            f"steps, global batch and optimizer")


def _losses(a: Summary, b: Summary) -> str:
    want, got = a.get("losses") or [], b.get("losses") or []
    if len(want) != len(got):
        return f"{len(want)} losses against {len(got)}"
    for k, (x, y) in enumerate(zip(want, got)):
        if not loss_within(y, x):
            return (f"the loss of step {k}: {x!r} against {y!r}"
                    f"{_rel_text(x, y)}, more than {LOSS_REL:g}")
    return ""


def _l2(a: Summary, b: Summary) -> str:
    x, y = a.get("param_l2"), b.get("param_l2")
    if l2_within(y, x):
        return ""
    return f"param_l2 {x!r} against {y!r}{_rel_text(x, y)}, more than {L2_REL:g}"


def _series(a: Summary, b: Summary) -> str:
    """Held-out losses and metrics, where both runs have them, judged like the losses."""
    ea, eb = a.get("eval_losses") or [], b.get("eval_losses") or []
    if ea and eb:
        if [s for s, _ in ea] != [s for s, _ in eb]:
            return f"held-out losses after steps {[s for s, _ in ea]} against {[s for s, _ in eb]}"
        for (step, x), (_, y) in zip(ea, eb):
            if not loss_within(y, x):
                return f"the held-out loss after step {step}: {x!r} against {y!r}{_rel_text(x, y)}"
    ma, mb = a.get("metrics") or [], b.get("metrics") or []
    if ma and mb:
        for k, (x, y) in enumerate(zip(ma, mb)):
            for name in sorted(set(x) | set(y)):
                if name not in x or name not in y or not loss_within(y[name], x[name]):
                    return (f"metric {name} of step {k}: {x.get(name)!r} against "
                            f"{y.get(name)!r}, more than {LOSS_REL:g} relative")
    return ""


def _counters(a: Summary, b: Summary) -> str:
    for who, s in zip(_WHO, (a, b)):
        if s.get("preemptions", 0) != counted(s):
            return (f"{who} counts {s.get('preemptions')} preemptions but its counters sum to "
                    f"{counted(s)}")
    return ""


def _largest_loss_rel(a: Summary, b: Summary) -> float:
    pairs = zip(a.get("losses") or [], b.get("losses") or [])
    rels = [abs(x - y) / abs(x) for x, y in pairs
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x]
    return max((r for r in rels if r == r), default=0.0)


def _rel_text(x: Any, y: Any) -> str:
    try:
        return f" ({abs(x - y) / abs(x):.1e} relative)"
    except (TypeError, ZeroDivisionError):
        return ""
