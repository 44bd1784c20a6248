"""`bamboo timeline`: the per-instruction timeline model of one step, with and
without redundancy, on costs given in milliseconds or read from a run's events.jsonl
(`bamboo.plan.timeline` is the model, `bamboo.run.measured` reads a run's costs).

    bamboo timeline --stages 4 --micro-batches 4 --forward 10 --backward 20
    bamboo timeline --events RUN/events.jsonl [--cores 2] [--frc-policy waits]
    bamboo timeline --pipelines 2 --lost 0:1       # a re-routed slot
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from bamboo.cli.parsing import UsageParser
from bamboo.plan import schedule as S
from bamboo.plan.reroute_timeline import rerouted_step
from bamboo.plan.timeline import Costs, compare, simulate_step
from bamboo.plan.timeline_text import render, summary
from bamboo.util import strict_json

__all__ = ["main", "timeline_parser"]


def timeline_parser() -> UsageParser:
    """The flags of the timeline model's command."""
    ap = UsageParser(
        prog="bamboo timeline",
        description="Per-instruction timeline model of a 1F1B or ZB-H1 step with off/lazy/eager RC. "
                    "Costs from a run's events.jsonl or given in milliseconds.")
    ap.add_argument("--events", help="events.jsonl of a run (eager runs give the forward/"
                                     "backward split; else --backward-ratio)")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps to leave out (default 1)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--forward", default="10", help="ms per micro-batch, one or per stage")
    ap.add_argument("--backward", default="20", help="ms per micro-batch, one or per stage")
    ap.add_argument("--frc", help="ms of the FRC forward of each stage (default: --forward)")
    ap.add_argument("--backward-ratio", type=float, default=2.0)
    ap.add_argument("--latency", type=float, default=0.0, help="ms per transfer")
    ap.add_argument("--commit", type=float, default=0.0, help="ms")
    ap.add_argument("--optim", default="0", help="ms per stage")
    ap.add_argument("--cores", type=int, help="share N processors among all nodes")
    ap.add_argument("--frc-policy", choices=("slot", "waits"), default="slot",
                    help="as the engine's --frc-at: waits, FRC only when a node would block "
                         "on a receive; slot: FRC where node_schedule puts it")
    ap.add_argument("--schedule", choices=sorted(S.SCHEDULES), default="1f1b",
                    help="as the engine's --schedule")
    ap.add_argument("--weight-share", type=float, default=0.5,
                    help="zb-h1: the weight gradient's part of a backward (default 0.5)")
    ap.add_argument("--pipelines", type=int, default=1,
                    help="with --lost: data-parallel pipelines D")
    ap.add_argument("--lost", help="D:S[,D:S...]: the step while these slots are re-routed to "
                                   "their data-parallel peers (--redundancy reroute), against the "
                                   "step while stage S is shadowed by its predecessor")
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--no-ascii", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    return ap


def _floats(text: str, stages: int) -> tuple[float, ...]:
    values = [float(x) for x in text.split(",")]
    if len(values) == 1:
        values *= stages
    if len(values) != stages:
        raise SystemExit(f"error: expected 1 or {stages} comma-separated values, got {text!r}")
    return tuple(values)


def _costs(args: argparse.Namespace) -> tuple[int, int, Costs]:
    """(P, M, costs): from the run's events with --events, else from the flags."""
    if args.events:
        from bamboo.run.measured import costs_from_events
        P, M, costs, notes = costs_from_events(args.events, skip=args.skip,
                                               backward_ratio=args.backward_ratio,
                                               latency=args.latency / 1e3)
        if not args.json:
            print(f"costs from {args.events}: {notes}")
    else:
        P, M = args.stages, args.micro_batches
        ms = lambda text: tuple(x / 1e3 for x in _floats(text, P))  # noqa: E731 (a one-line parser)
        costs = Costs(forward=ms(args.forward), backward=ms(args.backward),
                      frc=ms(args.frc) if args.frc else None, latency=args.latency / 1e3,
                      commit=args.commit / 1e3, optim=ms(args.optim),
                      weight_share=args.weight_share)
    if not args.json:
        print("per-stage ms  forward " + " ".join(f"{1e3 * x:.2f}" for x in costs.forward)
              + "  backward " + " ".join(f"{1e3 * x:.2f}" for x in costs.backward)
              + f"  commit {1e3 * costs.commit:.2f}")
    if args.events:
        costs = replace(costs, weight_share=args.weight_share)
    return P, M, costs


def main(argv: Sequence[str] | None = None) -> int:
    """Print the model's step times (a table and ASCII timelines, or --json); 0."""
    args = timeline_parser().parse_args(argv)
    P, M, costs = _costs(args)
    if args.lost:
        return _print_reroute(P, M, args.pipelines, args.lost, costs, args.schedule, args.json)
    cmp = compare(P, M, costs, cores=args.cores, frc_policy=args.frc_policy,
                  schedule=args.schedule)
    if args.json:
        print(strict_json.dumps(summary(cmp)))
    else:
        print(render(cmp, width=args.width, show=not args.no_ascii))
    return 0


def _print_reroute(P: int, M: int, D: int, text: str, costs: Costs, schedule: str,
                   as_json: bool) -> int:
    try:
        lost = [(int(a), int(b)) for a, b in (x.split(":") for x in text.split(","))]
        if any(not (0 <= d < D and 0 <= s < P) for d, s in lost):
            raise ValueError
    except ValueError:
        raise SystemExit(f"error: --lost {text!r}: write D:S[,D:S...] with D < {D}, S < {P}") from None
    clean = rerouted_step(P, M, D, [], costs, schedule=schedule).step_s
    try:
        rerouted = rerouted_step(P, M, D, lost, costs, schedule=schedule).step_s
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    shadowed = None
    if P > 1 and len({s for _, s in lost}) == 1 and len(lost) == 1:
        s = lost[0][1]
        pred = (s - 1) % P
        held = [[x] for x in range(P) if x not in (s, pred)] + [sorted({pred, s})]
        shadowed = simulate_step(P, M, "lazy", costs, held=held, schedule=schedule).step_s
    figures = {"failure_free_s": clean, "rerouted_s": rerouted, "shadowed_s": shadowed}
    if as_json:
        print(strict_json.dumps(figures))
    else:
        print(f"timeline model: P={P} D={D} M={M}, lost {text}, one processor per node, {schedule}")
        print(f"  failure-free step {1e3 * clean:.2f} ms")
        print(f"  re-routed to peers {1e3 * rerouted:.2f} ms ({rerouted / clean:.3f}x)")
        if shadowed is not None:
            print(f"  shadowed (lazy)    {1e3 * shadowed:.2f} ms ({shadowed / clean:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
