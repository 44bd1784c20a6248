"""The `bamboo` command: train, simulate.

    bamboo train --nodes 4 --stages 4 --steps 50          # a local 4-stage pipeline
    bamboo train --nodes 8 --stages 4 --json              # 2 pipelines, summary on stdout
    bamboo simulate --trace traces/p3.csv --json          # project a spot trace

Arguments are validated before torch is imported, so a user error costs a fraction
of a second and prints one line: what is wrong and how to fix it.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from bamboo.config import ConfigError, JobConfig, parse_kill
from bamboo.presets import PRESETS

__all__ = ["main"]

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _train_parser(given_only: bool = False) -> argparse.ArgumentParser:
    """The parser of `bamboo train`; with `given_only`, flags the user did not type are absent
    (so a --config file's values are overridden only by flags actually given)."""
    d = JobConfig()
    p = _Parser(prog="bamboo train", description="Train on a local cluster of worker processes, "
                "one per node, with a coordinator process holding the store.")

    def opt(*names: str, default: object = None, **kw: object) -> None:
        p.add_argument(*names, default=argparse.SUPPRESS if given_only else default, **kw)

    opt("--config", help="a YAML or TOML job file (see `bamboo config --example`); flags override it")
    opt("--model", default=d.model, help=f"preset: {', '.join(PRESETS)}")
    opt("--nodes", type=int, default=d.nodes, help="worker processes (default 4)")
    opt("--stages", type=int, default=d.stages, help="pipeline stages P (default 4)")
    opt("--pipelines", type=int, help="data-parallel pipelines D (default nodes // stages)")
    opt("--micro-batches", type=int, default=d.micro_batches,
        help="micro-batches per pipeline per step (default 4)")
    opt("--micro-batch-size", type=int, default=d.micro_batch_size,
        help="samples per micro-batch (default 8)")
    opt("--steps", type=int, default=d.steps, help="optimizer steps (default 50)")
    opt("--seed", type=int, default=d.seed)
    opt("--redundancy", default=d.redundancy, help="eager | lazy | off (default eager)")
    opt("--frc-offload", action="store_true", default=False,
        help="keep eager FRC's saved tensors in CPU memory until a failover needs them")
    opt("--data", help="UTF-8 text file (byte tokens); default synthetic")
    opt("--lr", type=float, default=d.lr, help="peak learning rate (default 3e-3)")
    opt("--warmup-steps", type=int, default=d.warmup_steps)
    opt("--weight-decay", type=float, default=d.weight_decay)
    opt("--grad-clip", type=float, default=d.grad_clip,
        help="global gradient-norm clip, 0 to disable (default 1.0)")
    opt("--threads", type=int, default=d.threads, help="torch threads per worker")
    opt("--comm-timeout", type=float, default=d.comm_timeout_s, dest="comm_timeout_s",
        help="seconds any communication call may block (default 60)")
    opt("--lease", type=float, default=d.lease_s, dest="lease_s",
        help="seconds without a heartbeat before a node is fenced (default 10)")
    opt("--device", default=d.device, help="auto | cpu | cuda")
    opt("--kill", action="append", default=[], metavar="D:S@K[+notice]",
        help="SIGKILL the holder of stage S of pipeline D inside step K (repeatable)")
    opt("--crash", action="append", default=[], metavar="D:S@K",
        help="make that node raise a Python exception in step K (software-error test)")
    opt("--check-replicas", action="store_true", default=False,
        help="compare every replica's digest with its primary's after every step")
    opt("--out", help="run directory (default runs/<timestamp>)")
    opt("--json", action="store_true", default=False, help="print summary.json on stdout when done")
    opt("--quiet", action="store_true", default=False, help="no progress on stderr")
    opt("--debug", action="store_true", default=False, help="show tracebacks")
    return p


_FIELDS = ("model", "nodes", "stages", "pipelines", "micro_batches", "micro_batch_size", "steps",
           "seed", "redundancy", "frc_offload", "data", "lr", "warmup_steps", "weight_decay", "grad_clip",
           "threads", "comm_timeout_s", "lease_s", "device", "out")


def _config(args: argparse.Namespace, argv: list[str]) -> JobConfig:
    if args.config is None:
        fields = {k: getattr(args, k) for k in _FIELDS}
        return JobConfig(kills=[parse_kill(k) for k in args.kill], **fields).validate()
    from bamboo.configfile import load_job_config
    given = vars(_train_parser(given_only=True).parse_args(argv))
    overrides = {k: v for k, v in given.items() if k in _FIELDS}
    if "kill" in given:
        overrides["kills"] = [parse_kill(k) for k in given["kill"]]
    return load_job_config(args.config, overrides)


def _crash_faults(cfg: JobConfig, specs: list[str]) -> dict[int, list]:
    from bamboo.faults import Fault
    out: dict[int, list] = {}
    for text in specs:
        k = parse_kill(text)
        if k.pipeline >= cfg.data_parallel or k.stage >= cfg.stages or k.step >= cfg.steps:
            raise ConfigError(f"--crash {text} names no node or step of this run")
        out.setdefault(k.pipeline * cfg.stages + k.stage, []).append(Fault("raise", k.step))
    return out


def train(argv: list[str]) -> int:
    args = _train_parser().parse_args(argv)
    try:
        cfg = _config(args, argv)
        crash = _crash_faults(cfg, args.crash)
        from bamboo.runlog import RunDir, default_run_dir
        run = RunDir(cfg.out or default_run_dir())
        run.check_usable()
    except ConfigError as e:
        print(f"bamboo train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from bamboo.cluster import forkserver
    forkserver.start()  # imports torch in the background while this process does too
    from bamboo.cluster.launcher import RunFailed, run_local
    from bamboo.progress import ProgressDisplay
    display = ProgressDisplay(cfg.steps, enabled=not args.quiet)
    try:
        summary = run_local(cfg, run, display, crash, debug=args.debug,
                            check_replicas=args.check_replicas)
    except RunFailed as e:
        print(f"bamboo train: error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps(e.summary, indent=2))
        return e.exit_code
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        first, last = summary["losses"][0], summary["losses"][-1]
        print(f"done: {summary['steps_completed']} steps, loss {first:.4f} -> {last:.4f}, "
              f"{summary['throughput']:.1f} samples/s; run directory {run.path}", file=sys.stderr)
    return 0


def _simulate(argv: list[str]) -> int:
    from bamboo.sim.cli import main as simulate_main
    return simulate_main(argv)


def _report(argv: list[str]) -> int:
    from bamboo.report import main as report_main
    return report_main(argv)


def _profile(argv: list[str]) -> int:
    from bamboo.profile import main as profile_main
    return profile_main(argv)


def _config_command(argv: list[str]) -> int:
    p = _Parser(prog="bamboo config", description="Job files for `bamboo train --config`.")
    p.add_argument("--example", action="store_true", help="print a commented example job file")
    args = p.parse_args(argv)
    if not args.example:
        p.error("nothing to do; use --example")
    from bamboo.configfile import example_config
    print(example_config(), end="")
    return 0


_COMMANDS = {"train": train, "simulate": _simulate, "report": _report, "config": _config_command,
             "profile": _profile}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bamboo {train,simulate,report,config,profile} ...\n\n"
              "  train     train a model on a local cluster of worker processes\n"
              "  simulate  project throughput and cost of a spot trace\n"
              "  report    write the text summary and plots of a run directory\n"
              "  profile   measure a model's step costs here for `simulate --costs`\n"
              "  config    print an example job file (--example)", file=sys.stderr)
        return 0 if argv else EXIT_USAGE
    command = _COMMANDS.get(argv[0])
    if command is None:
        print(f"bamboo: error: unknown command '{argv[0]}'; choose one of: "
              f"{', '.join(_COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    debug = "--debug" in argv
    try:
        return command(argv[1:])
    except KeyboardInterrupt:
        print("bamboo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the one place an unexpected error becomes a single line
        if debug:
            raise
        print(f"bamboo: internal error: {type(e).__name__}: {e} (rerun with --debug for the "
              f"traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
