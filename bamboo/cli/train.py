"""`bamboo train`: a job on a local cluster of worker processes (and, through a `JobCommand`,
the same sequence for `bamboo coordinator`, whose nodes are agents on other machines).

Arguments are validated before torch is imported, so a user error costs a fraction of a
second and prints one line: what is wrong and how to fix it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from bamboo.util import strict_json
from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from bamboo.config import ConfigError, JobConfig, all_options, options_by_key, parse_kill
from bamboo.config.options import add_flags

if TYPE_CHECKING:
    from bamboo.control.sources import NodeSource

__all__ = ["main", "run", "train_parser", "job_config", "JobCommand", "TrainCommand"]


SECTION_TITLES = {
    "model": "model", "data": "data", "layout": "layout: nodes, pipelines, stages, micro-batches",
    "training": "training", "redundancy": "redundancy and recovery",
    "runtime": "runtime: devices, threads, communication",
    "cluster": "the local cluster: injected preemptions and trace replay",
    "checkpoints": "checkpoints", "evaluation": "evaluation",
    "logging": "the run directory and logging",
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
    if args.config is None:
        values = {k: v for k, v in vars(args).items() if k in keys}
        values["kills"] = [parse_kill(k) for k in values["kills"]]
        return JobConfig.of(**values).validate()
    from bamboo.config.jobfile import load_job_config
    overrides = {k: v for k, v in vars(given.parse_args(argv)).items() if k in keys}
    if "kills" in overrides:
        overrides["kills"] = [parse_kill(k) for k in overrides["kills"]]
    return load_job_config(args.config, overrides)


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


def _check_trace(cfg: JobConfig) -> None:
    """Parse the trace now, so a malformed row is a one-line error before anything starts."""
    if cfg.cluster.trace is None:
        return
    from bamboo.traces.trace import TraceError, load_trace
    try:
        trace = load_trace(cfg.cluster.trace)
    except TraceError as e:
        raise ConfigError(f"--trace: {e}") from None
    if trace.unsorted_rows:
        print(f"bamboo train: warning: {cfg.cluster.trace}: {trace.unsorted_rows} row(s) out of time "
              f"order were sorted", file=sys.stderr)
    added = len({n for n, k in zip(trace.nodes, trace.kinds) if k == 1})
    if added < cfg.layout.nodes:
        raise ConfigError(f"--trace {cfg.cluster.trace} adds {added} distinct node(s) but --nodes is "
                          f"{cfg.layout.nodes}: the replay's initial workers are the trace's first "
                          f"--nodes adds; use --nodes {max(added, 1)} or a longer trace")


def _resolve_auto_resume(cfg: JobConfig, prog: str) -> tuple[JobConfig | None, bool]:
    """`--resume auto`: the --out run continues from its newest whole checkpoint when it has
    one, else starts there afresh (a restart before the first checkpoint starts over). None
    when that run already finished (a restarted job has nothing left to do)."""
    out = Path(cfg.logging.out)
    summary = out / "summary.json"
    if summary.is_file():
        try:
            done = json.loads(summary.read_text())
        except (OSError, ValueError):
            done = {}
        _check_same_job(cfg, done.get("config") or {}, f"--resume auto: the run in {out}")
        if done.get("status") == "completed" and \
                done.get("steps_completed", -1) >= cfg.training.steps:
            print(f"{prog}: the run in {out} already completed {cfg.training.steps} steps; "
                  f"nothing to do (pass more --steps, or another --out for a new run)",
                  file=sys.stderr)
            return None, False
    from bamboo.run.checkpoint import CheckpointError, list_checkpoints, load_latest
    from bamboo.run.runlog import checkpoint_root
    root = cfg.checkpoints.dir or checkpoint_root(out)
    if list_checkpoints(root):
        try:
            load_latest(root, quiet=True)
            return cfg.replace(resume=str(out)), False
        except CheckpointError as e:  # every one unusable: say so, then start over
            print(f"{prog}: warning: --resume auto: {e}; starting from step 0", file=sys.stderr)
    return cfg.replace(resume=None), out.exists()


def _check_same_job(cfg: JobConfig, made_with: dict[str, Any], what: str) -> None:
    """ConfigError when `made_with` (a checkpoint's meta, or a run's summary config) names a
    model, seed or batch other than this job's: continuing it would train another run."""
    if "global_micro_batches" not in made_with and "pipelines" in made_with \
            and "micro_batches" in made_with:
        made_with = made_with | {"global_micro_batches":
                                 made_with["pipelines"] * made_with["micro_batches"]}
    for key, value in (("model", cfg.model.name), ("seed", cfg.training.seed),
                       ("global_micro_batches", cfg.global_micro_batches),
                       ("micro_batch_size", cfg.layout.micro_batch_size)):
        if key in made_with and made_with[key] != value:
            raise ConfigError(f"{what} was made with {key} {made_with[key]!r}, this job has "
                              f"{value!r}: use the same settings (or another --out for a new "
                              f"run)")


def _load_resume(cfg: JobConfig) -> Any:
    """The checkpoint `--resume` continues from, checked against this job."""
    if cfg.checkpoints.resume is None:
        if cfg.checkpoints.dir is not None:
            from bamboo.run.checkpoint import has_whole_checkpoint
            if has_whole_checkpoint(cfg.checkpoints.dir):  # a restore would take another run's
                raise ConfigError(f"--checkpoint-dir {cfg.checkpoints.dir} holds the checkpoints "
                                  f"of an earlier run: continue it with --resume, or choose an "
                                  f"empty --checkpoint-dir")
        return None
    # No checkpoint at all is a user error found without importing torch (nor is torch
    # needed to find the newest whole one: its tensors stay where they are).
    from bamboo.run.checkpoint import CheckpointError, list_checkpoints, load_latest
    from bamboo.run.runlog import checkpoint_root
    # A run that wrote to --checkpoint-dir is resumed from there.
    root = cfg.checkpoints.dir or checkpoint_root(cfg.checkpoints.resume)
    if not list_checkpoints(root):
        raise ConfigError(f"--resume {cfg.checkpoints.resume}: no checkpoint in {root}: pass the --out "
                          f"directory of an earlier run that saved checkpoints (--checkpoint-every)")
    try:
        ckpt = load_latest(root, quiet=True)
    except CheckpointError as e:
        raise ConfigError(f"--resume {cfg.checkpoints.resume}: {e}") from None
    meta = ckpt.meta
    _check_same_job(cfg, meta, f"--resume {cfg.checkpoints.resume}: its checkpoint")
    if ckpt.warning:
        print(f"bamboo train: warning: {ckpt.warning}", file=sys.stderr)
    if ckpt.step >= cfg.training.steps:
        raise ConfigError(f"--resume {cfg.checkpoints.resume}: its checkpoint is at step {ckpt.step}, "
                          f"--steps is {cfg.training.steps}: ask for more steps")
    planned = meta.get("steps")
    if isinstance(planned, int) and planned != cfg.training.steps:
        # The learning rate's cosine decay ends at --steps (bamboo.engine.optim).
        how = "stretched" if cfg.training.steps > planned else "shortened"
        print(f"bamboo train: note: resuming a run planned for {planned} steps with --steps "
              f"{cfg.training.steps}: the learning-rate schedule is {how} to "
              f"{cfg.training.steps} steps (pass --steps {planned} to keep it)", file=sys.stderr)
    return ckpt


class JobCommand(Protocol):
    """What `bamboo train` and `bamboo coordinator` do differently around the same run:
    their parser, their own checks, and where the run's nodes come from."""

    prog: str

    def parser(self, given_only: bool = False) -> argparse.ArgumentParser:
        """The command's parser (the job's flags and the command's own)."""

    def check(self, args: argparse.Namespace, cfg: JobConfig | None) -> None:
        """ConfigError for a flag of this command that is wrong (cfg None: before the job)."""

    def source(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> NodeSource | int:
        """The run's nodes' source (`bamboo.control.sources`), or an exit code when it
        cannot start."""


class TrainCommand:
    """`bamboo train`: the nodes are worker processes this command starts."""

    prog = "bamboo train"

    def parser(self, given_only: bool = False) -> argparse.ArgumentParser:
        return train_parser(given_only)

    def check(self, args: argparse.Namespace, cfg: JobConfig | None) -> None:
        if cfg is not None:  # the local workers share this machine's memory
            from bamboo.model.fits import check_fits, check_step_length
            check_fits(cfg, cfg.node_cap)
            check_step_length(cfg)

    def source(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> NodeSource | int:
        from bamboo.control.sources import LocalWorkers
        return LocalWorkers()


def main(argv: list[str]) -> int:
    return run(argv, TrainCommand())


def run(argv: list[str], command: JobCommand) -> int:
    """The command's whole sequence, each stage a guard that ends in one line and an exit
    code: parse, job file, checks without torch, resume, run directory, the nodes' source
    (agents and etcd), then the run and its report."""
    prog = command.prog
    args = command.parser().parse_args(argv)
    try:
        command.check(args, None)
        http = None
        if args.http is not None:
            from bamboo.fleet.remote import parse_address
            try:
                http = parse_address(args.http, "--http")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        cfg = job_config(args, argv, command.parser(given_only=True))
        command.check(args, cfg)
        crash = _crash_faults(cfg, args.crash)
        _check_trace(cfg)
        from bamboo.run.runlog import RunDir, default_run_dir
        auto_fresh = False
        if cfg.checkpoints.resume == "auto":
            cfg, auto_fresh = _resolve_auto_resume(cfg, prog)
            if cfg is None:
                return 0
        run = RunDir(cfg.logging.out or cfg.checkpoints.resume or default_run_dir())
        resume_dir = cfg.checkpoints.resume
        same_dir = resume_dir is not None and run.path.resolve() == Path(resume_dir).resolve()
        run.restarting = auto_fresh
        if not same_dir and not auto_fresh:
            run.check_usable()
        resume = _load_resume(cfg)
        run.check_writable("--resume" if same_dir else "--out")
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    source = command.source(args, cfg, run)
    if isinstance(source, int):
        return source
    return _train(args, prog, cfg, run, source, crash=crash, resume=resume, http=http)


def _train(args: argparse.Namespace, prog: str, cfg: JobConfig, run: Any, source: NodeSource,
           *, crash: dict[int, list], resume: Any, http: tuple[str, int] | None) -> int:
    """The run itself, once every check passed, then its report: the exit code."""
    import os
    # torch's C++ store logs a warning, and for a client that vanishes mid-handshake an
    # error ("Write setup to client failed ... EBADF"), for what is here a preemption the
    # coordinator handles and reports itself; --debug shows its errors.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR" if args.debug else "FATAL")
    from bamboo.node import forkserver
    forkserver.start()  # imports torch in the background while this process does too
    from bamboo.control import RunFailed, run_job
    from bamboo.run.progress import ProgressDisplay
    from bamboo.run.runlog import RunDirError
    display = ProgressDisplay(cfg.training.steps, enabled=not args.quiet)
    serve_error: Any = ()  # catches nothing unless --http (prometheus_client loads only then)
    if http is not None:
        from bamboo.control.http import HttpServeError
        serve_error = HttpServeError
    try:
        summary = run_job(cfg, run, display, source, extra_faults=crash, debug=args.debug,
                          resume=resume, http=http)
    except serve_error as e:  # --http's address is taken or not this machine's
        source.close(None)
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
            print(strict_json.dumps(e.summary, indent=2))
        return e.exit_code
    if not args.no_report:
        write_run_report(run.path, args.quiet)
    if args.json:
        print(strict_json.dumps(summary, indent=2))
    else:
        first, last = summary["losses"][0], summary["losses"][-1]
        print(f"done: {summary['steps_completed']} steps, loss {first:.4f} -> {last:.4f}, "
              f"{summary['throughput']:.1f} samples/s; run directory {run.path}", file=sys.stderr)
    return 0
