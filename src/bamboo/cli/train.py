"""`bamboo train`: a job on a local cluster of worker processes (and, through a `JobCommand`,
the same sequence for `bamboo coordinator`, whose nodes are agents on other machines).

Arguments are validated before torch is imported, so a user error costs a fraction of a
second and prints one line: what is wrong and how to fix it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from bamboo.config import ConfigError, JobConfig, all_options, options_by_key, parse_kill
from bamboo.config.options import add_flags
from bamboo.util import strict_json

if TYPE_CHECKING:
    from bamboo.api.start import Start
    from bamboo.protocol.launch import Launcher

__all__ = ["main", "run", "train_parser", "job_config", "JobCommand", "TrainCommand"]


SECTION_TITLES = {
    "model": "model", "data": "data", "layout": "layout: nodes, pipelines, stages, micro-batches",
    "training": "training", "redundancy": "redundancy and recovery",
    "runtime": "runtime: devices, threads, communication",
    "cluster": "the local cluster: injected preemptions and trace replay",
    "checkpoints": "checkpoints", "evaluation": "evaluation",
    "logging": "the run directory and logging",
    "ray": "Ray: the nodes as actors on a Ray cluster",
}


def train_parser(given_only: bool = False) -> argparse.ArgumentParser:
    """The parser of `bamboo train`: one flag per job option (from its declaration in
    `bamboo.config.sections`), then this command's own. With `given_only`, flags the user
    did not type are absent (so a --config file's values are overridden only by flags
    actually given)."""
    p = UsageParser(prog="bamboo train", description="Train on a local cluster of worker "
                    "processes, one per node, with a coordinator process holding the store.")

    def opt(*names: str, default: object = None, **kw: object) -> None:
        p.add_argument(*names, default=argparse.SUPPRESS if given_only else default, **kw)

    opt("--config", help="a YAML or TOML job file (see `bamboo config --example`); flags override it")
    add_flags(p, list(all_options()), given_only=given_only, titles=SECTION_TITLES)
    opt("--crash", action="append", default=[], metavar="D:S@K",
        help="make that node raise a Python exception in step K (software-error test)")
    opt("--http", metavar="ADDR:PORT", help="serve /healthz and Prometheus /metrics there "
        "(e.g. 0.0.0.0:29402)")
    opt("--no-report", action="store_true", default=False,
        help="skip writing report.txt and the PNG plots at the end of the run")
    opt("--json", action="store_true", default=False, help="print summary.json on stdout when done")
    opt("--quiet", action="store_true", default=False, help="no progress on stderr")
    opt("--debug", action="store_true", default=False, help="show tracebacks")
    return p


def job_config(args: argparse.Namespace, argv: list[str],
               given: argparse.ArgumentParser) -> JobConfig:
    """The job the flags (and a --config file, which flags override) describe; `given` is
    the command's parser that leaves out what the user did not type."""
    keys = options_by_key()
    overrides = {k: v for k, v in vars(given.parse_args(argv)).items() if k in keys}
    if args.config is None:  # the same path as bamboo.Job's options; a default not typed is
        from bamboo.api.job import config_of  # left out (--global-batch-size then sets M)
        return config_of({k: v for k, v in vars(args).items() if k in keys and (
            k in overrides or v != keys[k].default)}, where=None)
    from bamboo.config.jobfile import load_job_config
    from bamboo.data.sizing import SIZING
    if "kills" in overrides:
        overrides["kills"] = [parse_kill(k) for k in overrides["kills"]]
    return load_job_config(args.config, overrides, SIZING)


def _crash_faults(cfg: JobConfig, specs: list[str]) -> dict[int, list]:
    from bamboo.plan.faults import Fault
    out: dict[int, list] = {}
    for text in specs:
        try:
            k = parse_kill(text)
        except ConfigError:
            k = None
        if k is None or k.notice:
            raise ConfigError(f"--crash '{text}' is malformed: write PIPELINE:STAGE@STEP, "
                              f"e.g. --crash 0:2@5")
        cfg.check_target("--crash", text, k)
        out.setdefault(k.pipeline * cfg.layout.stages + k.stage, []).append(Fault("raise", k.step))
    return out


def write_run_report(path: Path, quiet: bool) -> None:
    """report.txt and the PNG plots, at the end of every run (a failure here is a warning:
    the run's own files are already written)."""
    from bamboo.run.report import ReportError, write_report
    try:
        written = write_report(path)
    except (ReportError, OSError, ValueError) as e:
        print(f"bamboo train: warning: no report written: {e}", file=sys.stderr)
        return
    if not quiet:
        print(f"report: {written[0]} and {len(written) - 1} plots", file=sys.stderr)


class JobCommand(Protocol):
    """What `bamboo train` and `bamboo coordinator` do differently around the same run:
    their parser, their own flags' checks, and where the run's nodes come from."""

    prog: str
    nodes_here: bool
    """The nodes are worker processes of this machine (`bamboo.api.start.launch`)."""

    def parser(self, given_only: bool = False) -> argparse.ArgumentParser:
        """The command's parser (the job's flags and the command's own)."""

    def check(self, args: argparse.Namespace) -> None:
        """ConfigError for a flag of this command (not the job's) that is wrong."""

    def launcher(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> Launcher | int:
        """Where the run's nodes run (a `bamboo.launch` launcher), or an exit code when it
        cannot start."""


class TrainCommand:
    """`bamboo train`: the nodes are worker processes this command starts."""

    prog = "bamboo train"
    nodes_here = True

    def parser(self, given_only: bool = False) -> argparse.ArgumentParser:
        return train_parser(given_only)

    def check(self, args: argparse.Namespace) -> None:
        pass

    def launcher(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> Launcher | int:
        """Local worker processes, or with --ray actors on that Ray cluster; 1 (said in one
        line) when the cluster cannot be used."""
        from bamboo.api.start import Start, launcher_for
        from bamboo.protocol.launch import LaunchError
        try:
            return launcher_for(Start(cfg, run, None))
        except LaunchError as e:
            print(f"{self.prog}: error: {e}", file=sys.stderr)
            return 1


def main(argv: list[str]) -> int:
    return run(argv, TrainCommand())


def run(argv: list[str], command: JobCommand) -> int:
    """The command's whole sequence, each stage a guard that ends in one line and an exit
    code: parse, the job (its file and flags, checked without torch), the command's own
    flags, the job's launch (`bamboo.api.start.launch`: its checks, resume and run
    directory), the launcher (agents and etcd), then the run and its report. Under
    --json, stdout holds the summary alone (`json_out`)."""
    args = command.parser().parse_args(argv)
    from bamboo.cli.json_out import json_stdout
    with json_stdout(args.json) as out:
        return _run(args, argv, command, out)


def _run(args: argparse.Namespace, argv: list[str], command: JobCommand, out: TextIO) -> int:
    prog = command.prog
    crash: dict[int, list] = {}

    def check_crash(cfg: JobConfig) -> None:  # --crash names a node of the layout chosen
        crash.update(_crash_faults(cfg, args.crash))

    try:
        command.check(args)
        http = None
        if args.http is not None:
            from bamboo.config.join import parse_address
            try:
                http = parse_address(args.http, "--http")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        cfg = job_config(args, argv, command.parser(given_only=True))
        from bamboo.api.start import launch
        start = launch(cfg, prog, nodes_here=command.nodes_here, check=check_crash)
        if start is None:  # --resume auto: the run had finished; its summary is the answer
            if args.json:
                _print_summary(cfg.logging.out, out)
            return 0
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    launcher = command.launcher(args, start.cfg, start.run)
    if isinstance(launcher, int):
        return launcher
    return _train(args, prog, start, launcher, crash=crash, http=http, out=out)


def _print_summary(run_dir: str, out: TextIO) -> None:
    """A finished run's summary.json, printed as a run prints it (`--json`)."""
    from bamboo.api.run import load_result
    print(strict_json.dumps(load_result(run_dir).summary, indent=2), file=out)


def _train(args: argparse.Namespace, prog: str, start: Start, launcher: Launcher, *,
           crash: dict[int, list], http: tuple[str, int] | None, out: TextIO) -> int:
    """The run itself, once every check passed, then its report: the exit code."""
    from bamboo.api.start import execute, warm_up
    warm_up(args.debug)  # torch loads in the fork server while this process loads it too
    from bamboo.control import RunFailed
    from bamboo.run.progress import ProgressDisplay
    from bamboo.run.runlog import RunDirError
    run = start.run
    display = ProgressDisplay(start.cfg.training.steps, enabled=not args.quiet)
    serve_error: Any = ()  # catches nothing unless --http (prometheus_client loads only then)
    if http is not None:
        from bamboo.control.http import HttpServeError
        serve_error = HttpServeError
    try:
        summary = execute(start, launcher, display, crash=crash, debug=args.debug, http=http)
    except serve_error as e:  # --http's address is taken or not this machine's
        launcher.close(None)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RunDirError as e:  # the run's own files could not be written (a full disk)
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except RunFailed as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        if not args.no_report:
            write_run_report(run.path, args.quiet)
        if args.json:
            print(strict_json.dumps(e.summary, indent=2), file=out)
        return e.exit_code
    if not args.no_report:
        write_run_report(run.path, args.quiet)
    if args.json:
        print(strict_json.dumps(summary, indent=2), file=out)
    else:
        first, last = summary["losses"][0], summary["losses"][-1]
        print(f"done: {summary['steps_completed']} steps, loss {first:.4f} -> {last:.4f}, "
              f"{summary['throughput']:.1f} samples/s; run directory {run.path}", file=sys.stderr)
    return 0
