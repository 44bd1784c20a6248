"""A real run's costs for the timeline model: per-stage forward, backward, commit and
optimizer seconds, read from the node timers in its events.jsonl."""
from __future__ import annotations

import statistics
from pathlib import Path

from bamboo.plan.timeline import Costs
from bamboo.run.runlog import read_events

__all__ = ["costs_from_events"]


def costs_from_events(path: str | Path, *, skip: int = 1, backward_ratio: float = 2.0,
                      latency: float = 0.0) -> tuple[int, int, Costs, dict]:
    """(P, M, costs, notes) from a run's events.jsonl.

    Per stage, the median over clean steps (after `skip` warm-up steps; steps with a
    lost node or a redone round are left out) of the node timers, divided by the
    instruction counts: compute_s / M is forward + backward of one micro-batch; in an
    eager run frc_s / M at node s is the forward of stage s+1, which splits it;
    otherwise backward = `backward_ratio` x forward. The optimizer time of an eager run
    is split between primary and replica by their sizes (state_bytes, bytes_replica), and
    so is a lazy run's from before its replicas lived in host memory. A lazy run whose nodes
    report a replica in host memory (`replica_host_bytes`) stepped it on a thread of its
    own, outside optim_s: a replica's step is taken to cost what its stage's own step costs
    on its primary. (The benchmark knob `BAMBOO_REPLICA_STEP=inline`, which steps a host
    replica inside optim_s, is not recorded: such a run reads as stepping it outside.)
    These are wall times as the workers saw them: with more processes than cores they
    include the slowdown of sharing the cores.
    """
    events = read_events(path)
    start = next(e for e in events if e["event"] == "run_start")["config"]
    P, M = int(start["stages"]), int(start["micro_batches"])
    mode = start.get("redundancy", "eager") if P > 1 else "off"
    failed = {e["step"] for e in events if e["event"] in ("fault_detected", "node_lost")}
    steps = [e for e in events if e["event"] == "step_done" and e["step"] >= skip
             and e["step"] not in failed and e.get("attempts", 1) == 1]
    if not steps:
        raise ValueError(f"{path}: no clean step after the first {skip}")
    med = _stage_medians(steps, P, path)
    fwd, bwd = _forward_backward(med, P, M, mode, backward_ratio)
    optim, replica_optim = _optimizer_shares(med, P, mode)
    costs = Costs(forward=tuple(fwd), backward=tuple(bwd), frc=None, latency=latency,
                  commit=statistics.median(med[s]["reduce_s"] for s in range(P)),
                  optim=tuple(optim),
                  replica_optim=tuple(replica_optim) if mode != "off" else None)
    notes = {"mode": mode, "steps_used": len(steps), "nodes": start.get("nodes"),
             "forward_split": "from FRC timers" if mode == "eager" else
             f"backward = {backward_ratio} x forward",
             "measured_step_s": statistics.median(e["wall_s"] for e in steps)}
    return P, M, costs, notes


def _stage_medians(steps: list[dict], P: int, path: str | Path) -> dict[int, dict[str, float]]:
    """Stage -> the median of each timer of its single-stage nodes over `steps`."""
    per_stage: dict[int, dict[str, list[float]]] = {s: {} for s in range(P)}
    for e in steps:
        for node in e["nodes"]:
            if len(node["stages"]) != 1:
                continue
            d = per_stage[node["stages"][0]]
            for k in ("compute_s", "frc_s", "reduce_s", "optim_s", "state_bytes",
                      "params_held", "bytes_replica", "replica_host_bytes"):
                d.setdefault(k, []).append(float(node.get(k, 0.0)))
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in per_stage.items()}
    if any(not med[s] for s in range(P)):
        raise ValueError(f"{path}: some stage has no single-stage node report")
    return med


def _forward_backward(med: dict[int, dict[str, float]], P: int, M: int, mode: str,
                      backward_ratio: float) -> tuple[list[float], list[float]]:
    """Each stage's forward and backward seconds of one micro-batch."""
    fwd, bwd = [], []
    for s in range(P):
        c = med[s]["compute_s"] / M
        f = med[(s - 1) % P]["frc_s"] / M if mode == "eager" else 0.0
        if not 0.0 < f < c:
            f = c / (1.0 + backward_ratio)
        fwd.append(f)
        bwd.append(c - f)
    return fwd, bwd


def _optimizer_shares(med: dict[int, dict[str, float]], P: int,
                      mode: str) -> tuple[list[float], list[float]]:
    """Each stage's optimizer seconds, and those of its replica on the predecessor."""
    if mode == "lazy" and any(med[s]["replica_host_bytes"] > 0 for s in range(P)):
        own = [med[s]["optim_s"] for s in range(P)]  # the replicas stepped on their thread
        return own, own
    optim, replica_optim = [], [0.0] * P
    for s in range(P):
        o = med[s]["optim_s"]
        if mode != "off":
            # bytes_replica: this stage's reduced gradient sent to the predecessor's replica
            # (4 bytes per parameter); params_held: every parameter held, replica too (a
            # run recorded before it was reported: state_bytes, then 12 bytes a parameter).
            numel_own = med[s]["bytes_replica"] / 4.0
            numel_all = med[s]["params_held"] or med[s]["state_bytes"] / 12.0
            share = 1.0 - numel_own / numel_all if 0 < numel_own < numel_all else 0.5
            replica_optim[(s + 1) % P] = o * share
            o *= 1.0 - share
        optim.append(o)
    return optim, replica_optim
