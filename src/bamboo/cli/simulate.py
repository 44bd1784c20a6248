"""``bamboo simulate``: project throughput, cost and value of policies on a preemption trace
(the simulator is `bamboo.sim`; this module reads the flags and prints the result).

Examples::

    bamboo simulate --trace traces/aws-p3-2xlarge.csv --model gpt2 --json
    bamboo simulate --trace synthetic:p=0.10 --nodes 48 --hours 12 --runs 1000 --seed 1
    python -m bamboo.sim --trace synthetic:mtbf=1h --policies bamboo,adaptive --plot out/

User errors print one line on stderr and exit with status 2 (``--debug`` shows the
traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from bamboo.cli.parsing import UsageParser as _Parser  # one-line usage errors, exit 2
from bamboo.util import strict_json

__all__ = ["main", "build_parser"]


class _UserError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bamboo simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="trace file (Bamboo CSV, count rows or JSON rows), "
                   "or synthetic:p=PROB[,alloc=A] / synthetic:mtbf=DURATION")
    from bamboo.sim.cost_presets import SIM_MODELS
    from bamboo.sim.policies import POLICIES
    p.add_argument("--model", default="gpt2",
                   help=f"a model with published step times: {', '.join(m.name for m in SIM_MODELS.values())} "
                        f"(default gpt2); or any bamboo train model (gpt2-tiny, llama-tiny, ...) with "
                        f"--costs from bamboo profile --model NAME")
    p.add_argument("--policies", default="bamboo,checkpoint,on-demand",
                   help=f"comma-separated: {', '.join(POLICIES)}")
    p.add_argument("--runs", type=int, default=1, help="Monte Carlo runs (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic traces and random placement")
    p.add_argument("--costs", help="costs file written by 'bamboo profile' (schema bamboo.costs/1)")
    p.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--nodes", type=int, default=48, help="synthetic traces: instances requested (default 48)")
    p.add_argument("--hours", type=float, default=12.0, help="synthetic traces: length in hours (default 12)")
    p.add_argument("--checkpoint-every", type=float, default=10.0, metavar="MIN",
                   help="checkpoint and torchrun policies: minutes between checkpoints (default 10)")
    p.add_argument("--restart-s", type=float, help="checkpoint and torchrun policies: seconds to restart from a checkpoint")
    p.add_argument("--ckpt-save-s", type=float, help="seconds to write one checkpoint")
    p.add_argument("--fallback-every", type=float, default=30.0, metavar="MIN",
                   help="bamboo/adaptive: minutes between durable fallback checkpoints (0: none; default 30)")
    p.add_argument("--fatal-mode", choices=("rollback", "restart"), default="rollback",
                   help="bamboo: a fatal failure with no live copy rolls back to the last checkpoint "
                        "(rollback, default) or restarts losing nothing (restart: the authors' simulator)")
    p.add_argument("--placement", choices=("auto", "ordered", "random"), default="auto",
                   help="node placement on (pipeline, stage); auto: ordered for one run of a file trace")
    p.add_argument("--on-demand", default="matched",
                   help="on-demand cluster: matched (mean spot size, no RC), ref (authors' reference) or N nodes")
    p.add_argument("--spot-price", type=float, default=0.91, help="$/instance-hour, spot (default 0.91)")
    p.add_argument("--on-demand-price", type=float, default=3.06, help="$/instance-hour, on-demand (default 3.06)")
    p.add_argument("--alloc-delay", type=float, default=45.0, help="seconds before a new instance is ready")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes for --runs")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise _UserError(f"--runs {args.runs}: must be at least 1")
    if args.jobs < 1:
        raise _UserError(f"--jobs {args.jobs}: must be at least 1")
    if args.nodes < 1:
        raise _UserError(f"--nodes {args.nodes}: must be at least 1")
    if not 0 < args.hours <= 24 * 365:
        raise _UserError(f"--hours {args.hours}: must be positive")
    for flag in ("checkpoint_every", "spot_price", "on_demand_price", "alloc_delay", "fallback_every"):
        v = getattr(args, flag)
        if v < 0 or v != v:
            raise _UserError(f"--{flag.replace('_', '-')} {v}: must be a non-negative number")
    if args.checkpoint_every <= 0:
        raise _UserError("--checkpoint-every must be positive (minutes between checkpoints)")
    for flag in ("restart_s", "ckpt_save_s"):
        v = getattr(args, flag)
        if v is not None and (v < 0 or v != v):
            raise _UserError(f"--{flag.replace('_', '-')} {v}: must be a non-negative number of seconds")
    od = args.on_demand
    if od not in ("matched", "ref") and not (od.isdigit() and int(od) > 0):
        raise _UserError(f"--on-demand {od!r}: use matched, ref or a positive node count")


def _table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{summary['trace']} | {summary['model']} | {summary['hours']:.2f} h | runs={summary['runs']}")
    for col in ("policy", "samples/s", "$/h", "samples/$", "preempt.", "fatal", "reconf.", "steps",
                "useful", "redund.", "ckpt", "restart", "rebal.", "lost", "idle"):
        t.add_column(col, justify="right")
    for name, e in summary["policies"].items():
        b = e["breakdown"]
        t.add_row(name, f"{e['throughput']:.2f}", f"{e['cost_per_hour']:.2f}", f"{e['value']:.0f}",
                  str(e["preemptions"]), str(e["fatal_failures"]), str(e["reconfigurations"]), str(e["steps"]),
                  *(f"{100 * b[c]:.1f}%" for c in ("useful", "redundant", "checkpoint", "restart",
                                                    "rebalance", "lost", "idle")))
    Console(width=160).print(t)


def _model(name: str, costs_file: str | None):
    """The simulated model called `name`: one of the simulator's own (published step times),
    or a `bamboo train` model measured by `bamboo profile` (its --costs file is then required:
    the step times are what a simulation needs). Both sets of names are accepted."""
    from bamboo.config.presets import PRESETS as TRAIN_MODELS
    from bamboo.sim.cost_presets import SIM_MODELS, get_preset, preset_from_costs
    from bamboo.sim.costs import load_costs
    try:
        base = get_preset(name)
    except KeyError:
        if name not in TRAIN_MODELS and ":" not in name:
            known = ", ".join(m.name for m in SIM_MODELS.values())
            raise _UserError(f"--model {name!r} is not a model: use one of {known} (published step "
                             f"times) or a bamboo train model ({', '.join(sorted(TRAIN_MODELS))}) "
                             f"with --costs") from None
        if not costs_file:
            raise _UserError(f"--model {name} needs its measured costs: run `bamboo profile --model "
                             f"{name} --out costs.json`, then add --costs costs.json") from None
        base = get_preset("gpt2")  # only its recovery costs stand in where the file has none
    return preset_from_costs(load_costs(costs_file), base) if costs_file else base


def _run(args: argparse.Namespace) -> int:
    from bamboo.sim.core import SimConfig
    from bamboo.sim.policies import POLICIES
    from bamboo.sim.runner import resolve_trace, run_policies, summarize

    _check(args)
    preset = _model(args.model, args.costs)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise _UserError(f"--policies: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(POLICIES)}")
    policies = list(dict.fromkeys(policies))
    source = resolve_trace(args.trace, nodes=args.nodes, hours=args.hours)
    first = source.make(0)
    if first.unsorted_rows:
        print(f"warning: {args.trace}: {first.unsorted_rows} row(s) out of time order were sorted", file=sys.stderr)
    if first.duration <= 0:
        raise _UserError(f"{args.trace}: the trace covers no time (all rows at time 0)")
    placement = args.placement
    if placement == "auto":
        placement = "random" if (args.runs > 1 and not source.synthetic) else "ordered"
    config = SimConfig(
        spot_price=args.spot_price,
        on_demand_price=args.on_demand_price,
        alloc_delay_s=args.alloc_delay,
        checkpoint_every_s=args.checkpoint_every * 60.0,
        ckpt_save_s=args.ckpt_save_s,
        restart_s=args.restart_s,
        fallback_every_s=args.fallback_every * 60.0,
        fatal_rollback=args.fatal_mode == "rollback",
        placement=placement,
        on_demand=args.on_demand,
    )
    results = run_policies(source, policies, preset, config, runs=args.runs, seed=args.seed,
                           jobs=args.jobs, record_first=bool(args.plot))
    summary = summarize(source, preset, results, runs=args.runs, seed=args.seed)
    if args.plot:
        from bamboo.sim.plots import write_plots

        try:
            write_plots({n: rs[0] for n, rs in results.items()}, args.plot, f"{preset.name} on {source.label}")
        except OSError as exc:
            raise _UserError(f"--plot {args.plot}: cannot write plots ({exc.strerror or exc})") from None
    if args.json:
        sys.stdout.write(strict_json.dumps(summary, sort_keys=True, indent=2) + "\n")
    else:
        _table(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``bamboo simulate``; returns the exit status."""
    from bamboo.sim.costs import CostsError
    from bamboo.traces.trace import TraceError

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return _run(args)
    except (_UserError, TraceError, CostsError) as exc:
        if debug:
            raise
        print(f"bamboo simulate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bamboo simulate: interrupted", file=sys.stderr)
        return 130
