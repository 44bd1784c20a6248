"""`bamboo train`: a job on a local cluster of worker processes (and, through a `NodeSource`,
the same sequence for `bamboo coordinator`, whose nodes are agents on other machines).

Arguments are validated before torch is imported, so a user error costs a fraction of a
second and prints one line: what is wrong and how to fix it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Protocol

from bamboo.argparsing import EXIT_USAGE, UsageParser
from bamboo.config import HEARTBEAT_S, ConfigError, JobConfig, parse_kill
from bamboo.presets import PRESETS

__all__ = ["main", "run", "train_parser", "job_config", "NodeSource", "LocalWorkers", "FIELDS"]


def train_parser(given_only: bool = False) -> argparse.ArgumentParser:
    """The parser of `bamboo train`; with `given_only`, flags the user did not type are absent
    (so a --config file's values are overridden only by flags actually given).

    Long because it is the flat list of every flag with its help, which reads best in one
    place (tests/test_cli_errors.py holds a wrong-value case for each)."""
    d = JobConfig()
    p = UsageParser(prog="bamboo train", description="Train on a local cluster of worker "
                    "processes, one per node, with a coordinator process holding the store.")

    def opt(*names: str, default: object = None, **kw: object) -> None:
        p.add_argument(*names, default=argparse.SUPPRESS if given_only else default, **kw)

    opt("--config", help="a YAML or TOML job file (see `bamboo config --example`); flags override it")
    opt("--model", default=d.model, help=f"preset: {', '.join(PRESETS)}; or a Hugging Face "
        "model: hf:gpt2, hf:llama, hf:bert, hf:gpt2:n_layer=4,n_embd=128, hf:DIR; or your own "
        "model: MODULE:FUNCTION or FILE.py:FUNCTION (see docs/models.md)")
    opt("--nodes", type=int, default=d.nodes, help="worker processes (default 4)")
    opt("--stages", type=int, default=d.stages, help="pipeline stages P (default 4)")
    opt("--pipelines", type=int, help="data-parallel pipelines D (default nodes // stages)")
    opt("--micro-batches", type=int, default=d.micro_batches,
        help="micro-batches per pipeline per step (default 4)")
    opt("--micro-batch-size", type=int, default=d.micro_batch_size,
        help="samples per micro-batch (default 8)")
    opt("--steps", type=int, default=d.steps, help="optimizer steps (default 50)")
    opt("--seed", type=int, default=d.seed)
    opt("--redundancy", default=d.redundancy, help="eager | lazy | off | auto (default eager; "
        "auto picks one at every generation from the preemption rate and costs measured)")
    opt("--frc-offload", action="store_true", default=False,
        help="keep eager FRC's saved tensors in CPU memory until a failover needs them")
    opt("--comm", default=d.comm, help="strict (default): NCCL's rules on every backend (no "
        "tags, batched two-way exchanges, the group rebuilt after every loss) | tagged: gloo "
        "only, tagged transfers on a group that outlives lost peers")
    opt("--precision", default=d.precision, help="fp32 (default) | bf16: autocast bf16 "
        "compute with fp32 weights, gradients and optimizer state")
    opt("--exact", action="store_true", default=False, help="float64 gradient sums in "
        "pipeline order: every layout gives the same bits (default: fp32 and a collective)")
    opt("--activation-checkpointing", action="store_true", default=False,
        help="recompute each layer's activations in the backward instead of keeping them")
    opt("--data", help="a directory written by `bamboo data prepare` (the model's vocabulary "
        "follows its tokenizer's), or a UTF-8 text file (byte tokens); default synthetic")
    opt("--layer-costs", metavar="FILE", help="cut stages by measured seconds per layer "
        "(bamboo profile --layers-only) instead of parameter counts")
    opt("--eval-every", type=int, default=d.eval_every, metavar="K",
        help="every K steps and after the last, the held-out loss on the val split "
        "(eval_losses in summary.json; default 0: never)")
    opt("--eval-batches", type=int, default=d.eval_batches, metavar="N",
        help=f"val micro-batches per evaluation (default {d.eval_batches})")
    opt("--tensorboard", metavar="DIR", help="write TensorBoard event files to DIR "
        "(tensorboard --logdir DIR)")
    opt("--wandb", metavar="PROJECT", help="log the same scalars to a Weights & Biases project "
        "(needs the wandb package; WANDB_MODE=offline logs without network)")
    opt("--lr", type=float, default=d.lr, help="peak learning rate (default 3e-3)")
    opt("--warmup-steps", type=int, default=d.warmup_steps)
    opt("--weight-decay", type=float, default=d.weight_decay)
    opt("--grad-clip", type=float, default=d.grad_clip,
        help="global gradient-norm clip, 0 to disable (default 1.0)")
    opt("--threads", type=int, default=d.threads, help="torch threads per worker")
    opt("--comm-timeout", type=float, default=d.comm_timeout_s, dest="comm_timeout_s",
        help="seconds any communication call may block (default 60)")
    opt("--lease", type=float, default=d.lease_s, dest="lease_s",
        help=f"seconds without a heartbeat before a node is fenced (default 10; more than "
        f"the {HEARTBEAT_S:g} s between two heartbeats)")
    opt("--device", default=d.device, help="auto | cpu | cuda")
    opt("--kill", action="append", default=[], metavar="D:S@K[+notice]",
        help="SIGKILL the holder of stage S of pipeline D inside step K (repeatable)")
    opt("--crash", action="append", default=[], metavar="D:S@K",
        help="make that node raise a Python exception in step K (software-error test)")
    opt("--trace", help="replay this preemption trace on the local cluster (Bamboo CSV, count "
        "rows or JSON rows)")
    opt("--time-scale", type=float, default=d.time_scale,
        help="trace seconds per wall second when replaying (default 360)")
    opt("--max-nodes", type=int, help="at most this many workers alive at once (default --nodes)")
    opt("--notice-s", type=float,
        help="a preemption notice (SIGTERM) this many wall seconds before each kill")
    opt("--checkpoint-every", type=int, default=d.checkpoint_every,
        help="durable checkpoint every K steps, used only when every copy of a stage is lost")
    opt("--recovery", default=d.recovery,
        help="redundancy (default) | checkpoint-restart: the baseline that restarts every "
        "worker from the last checkpoint on each preemption (needs --redundancy off)")
    opt("--resume", metavar="DIR|auto", help="continue the run in DIR from its latest whole "
        "checkpoint; auto: continue the --out directory's run if it has a whole checkpoint, "
        "else start it (one command line for the first start and every restart)")
    opt("--keep-checkpoints", type=int, default=d.keep_checkpoints,
        help=f"whole checkpoints kept; older ones are pruned (default {d.keep_checkpoints})")
    opt("--checkpoint-dir", metavar="PATH|URL",
        help="where the nodes write checkpoints and the trained model's layers: an absolute "
        "path or a URL (s3://..., file:///...) every machine reaches at the same address "
        "(default RUN_DIR/checkpoints)")
    opt("--http", metavar="ADDR:PORT", help="serve /healthz and Prometheus /metrics there "
        "(e.g. 0.0.0.0:29402)")
    opt("--no-report", action="store_true", default=False,
        help="skip writing report.txt and the PNG plots at the end of the run")
    opt("--check-replicas", action="store_true", default=False,
        help="compare every replica's digest with its primary's after every step")
    opt("--out", help="run directory (default runs/<timestamp>)")
    opt("--json", action="store_true", default=False, help="print summary.json on stdout when done")
    opt("--quiet", action="store_true", default=False, help="no progress on stderr")
    opt("--debug", action="store_true", default=False, help="show tracebacks")
    return p


FIELDS = ("model", "nodes", "stages", "pipelines", "micro_batches", "micro_batch_size", "steps",
           "seed", "redundancy", "frc_offload", "comm", "precision", "exact",
           "activation_checkpointing", "data", "layer_costs", "eval_every", "eval_batches", "tensorboard",
           "wandb", "lr", "warmup_steps", "weight_decay", "grad_clip",
           "threads", "comm_timeout_s", "lease_s", "device", "trace", "time_scale", "max_nodes",
           "notice_s", "checkpoint_every", "recovery", "resume", "out", "keep_checkpoints",
           "checkpoint_dir")


def job_config(args: argparse.Namespace, argv: list[str]) -> JobConfig:
    """The job the flags (and a --config file, which flags override) describe."""
    if args.config is None:
        fields = {k: getattr(args, k) for k in FIELDS}
        return JobConfig(kills=[parse_kill(k) for k in args.kill], **fields).validate()
    from bamboo.configfile import load_job_config
    given = vars(train_parser(given_only=True).parse_args(argv))
    overrides = {k: v for k, v in given.items() if k in FIELDS}
    if "kill" in given:
        overrides["kills"] = [parse_kill(k) for k in given["kill"]]
    return load_job_config(args.config, overrides)


def _crash_faults(cfg: JobConfig, specs: list[str]) -> dict[int, list]:
    from bamboo.faults import Fault
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
        out.setdefault(k.pipeline * cfg.stages + k.stage, []).append(Fault("raise", k.step))
    return out


def write_run_report(path: Path, quiet: bool) -> None:
    """report.txt and the PNG plots, at the end of every run (a failure here is a warning:
    the run's own files are already written)."""
    from bamboo.report import ReportError, write_report
    try:
        written = write_report(path)
    except (ReportError, OSError, ValueError) as e:
        print(f"bamboo train: warning: no report written: {e}", file=sys.stderr)
        return
    if not quiet:
        print(f"report: {written[0]} and {len(written) - 1} plots", file=sys.stderr)


def _check_trace(cfg: JobConfig) -> None:
    """Parse the trace now, so a malformed row is a one-line error before anything starts."""
    if cfg.trace is None:
        return
    from bamboo.sim.traces import TraceError, load_trace
    try:
        trace = load_trace(cfg.trace)
    except TraceError as e:
        raise ConfigError(f"--trace: {e}") from None
    if trace.unsorted_rows:
        print(f"bamboo train: warning: {cfg.trace}: {trace.unsorted_rows} row(s) out of time "
              f"order were sorted", file=sys.stderr)
    added = len({n for n, k in zip(trace.nodes, trace.kinds) if k == 1})
    if added < cfg.nodes:
        raise ConfigError(f"--trace {cfg.trace} adds {added} distinct node(s) but --nodes is "
                          f"{cfg.nodes}: the replay's initial workers are the trace's first "
                          f"--nodes adds; use --nodes {max(added, 1)} or a longer trace")


def _resolve_auto_resume(cfg: JobConfig, prog: str) -> tuple[JobConfig | None, bool]:
    """`--resume auto`: the --out run continues from its newest whole checkpoint when it has
    one, else starts there afresh (a restart before the first checkpoint starts over). None
    when that run already finished (a restarted job has nothing left to do)."""
    import dataclasses
    out = Path(cfg.out)
    summary = out / "summary.json"
    if summary.is_file():
        try:
            done = json.loads(summary.read_text())
        except (OSError, ValueError):
            done = {}
        if done.get("status") == "completed" and done.get("steps_completed", -1) >= cfg.steps:
            print(f"{prog}: the run in {out} already completed {cfg.steps} steps; nothing to "
                  f"do (pass more --steps, or another --out for a new run)", file=sys.stderr)
            return None, False
    from bamboo.checkpoint import has_whole_checkpoint
    from bamboo.runlog import checkpoint_root
    if has_whole_checkpoint(cfg.checkpoint_dir or checkpoint_root(out)):
        return dataclasses.replace(cfg, resume=str(out)), False
    return dataclasses.replace(cfg, resume=None), out.exists()


def _load_resume(cfg: JobConfig) -> Any:
    """The checkpoint `--resume` continues from, checked against this job."""
    if cfg.resume is None:
        if cfg.checkpoint_dir is not None:
            from bamboo.checkpoint import has_whole_checkpoint
            if has_whole_checkpoint(cfg.checkpoint_dir):  # a restore would take another run's
                raise ConfigError(f"--checkpoint-dir {cfg.checkpoint_dir} holds the checkpoints "
                                  f"of an earlier run: continue it with --resume, or choose an "
                                  f"empty --checkpoint-dir")
        return None
    # No checkpoint at all is a user error found without importing torch (nor is torch
    # needed to find the newest whole one: its tensors stay where they are).
    from bamboo.checkpoint import CheckpointError, list_checkpoints, load_latest
    from bamboo.runlog import checkpoint_root
    # A run that wrote to --checkpoint-dir is resumed from there.
    root = cfg.checkpoint_dir or checkpoint_root(cfg.resume)
    if not list_checkpoints(root):
        raise ConfigError(f"--resume {cfg.resume}: no checkpoint in {root}: pass the --out "
                          f"directory of an earlier run that saved checkpoints (--checkpoint-every)")
    try:
        ckpt = load_latest(root)
    except CheckpointError as e:
        raise ConfigError(f"--resume {cfg.resume}: {e}") from None
    meta = ckpt.meta
    for key, value in (("model", cfg.model), ("seed", cfg.seed),
                       ("global_micro_batches", cfg.global_micro_batches),
                       ("micro_batch_size", cfg.micro_batch_size)):
        if key in meta and meta[key] != value:
            raise ConfigError(f"--resume {cfg.resume}: its checkpoint was made with {key} "
                              f"{meta[key]!r}, this job has {value!r}: use the same settings")
    if ckpt.warning:
        print(f"bamboo train: warning: {ckpt.warning}", file=sys.stderr)
    if ckpt.step >= cfg.steps:
        raise ConfigError(f"--resume {cfg.resume}: its checkpoint is at step {ckpt.step}, "
                          f"--steps is {cfg.steps}: ask for more steps")
    planned = meta.get("steps")
    if isinstance(planned, int) and planned != cfg.steps:
        # The learning rate's cosine decay ends at --steps (bamboo.pipeline.optim).
        how = "stretched" if cfg.steps > planned else "shortened"
        print(f"bamboo train: note: resuming a run planned for {planned} steps with --steps "
              f"{cfg.steps}: the learning-rate schedule is {how} to {cfg.steps} steps (pass "
              f"--steps {planned} to keep it)", file=sys.stderr)
    return ckpt


class NodeSource(Protocol):
    """Where a job's nodes come from: local worker processes, or agents that join."""

    prog: str

    def parser(self) -> argparse.ArgumentParser: ...

    def job_argv(self, argv: list[str]) -> list[str]:
        """The flags that describe the job (a --config file's overrides)."""

    def check(self, args: argparse.Namespace, cfg: JobConfig | None) -> None:
        """ConfigError for a flag of this source that is wrong (cfg None: before the job)."""

    def start(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> tuple[Any, Any] | int:
        """(agents, membership) for `run_local`, or an exit code when it cannot start."""


class LocalWorkers:
    """`bamboo train`: the nodes are worker processes this command starts."""

    prog = "bamboo train"

    def parser(self) -> argparse.ArgumentParser:
        return train_parser()

    def job_argv(self, argv: list[str]) -> list[str]:
        return argv

    def check(self, args: argparse.Namespace, cfg: JobConfig | None) -> None:
        pass

    def start(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> tuple[Any, Any] | int:
        return None, None


def main(argv: list[str]) -> int:
    return run(argv, LocalWorkers())


def run(argv: list[str], source: NodeSource) -> int:
    """The command's whole sequence, each stage a guard that ends in one line and an exit
    code: parse, job file, checks without torch, resume, run directory, the nodes' source
    (agents and etcd), then the run and its report."""
    prog = source.prog
    args = source.parser().parse_args(argv)
    argv = source.job_argv(argv)
    try:
        source.check(args, None)
        http = None
        if args.http is not None:
            from bamboo.cluster.remote import parse_address
            try:
                http = parse_address(args.http, "--http")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        cfg = job_config(args, argv)
        source.check(args, cfg)
        crash = _crash_faults(cfg, args.crash)
        _check_trace(cfg)
        from bamboo.runlog import RunDir, default_run_dir
        auto_fresh = False
        if cfg.resume == "auto":
            cfg, auto_fresh = _resolve_auto_resume(cfg, prog)
            if cfg is None:
                return 0
        run = RunDir(cfg.out or cfg.resume or default_run_dir())
        same_dir = cfg.resume is not None and run.path.resolve() == Path(cfg.resume).resolve()
        run.restarting = auto_fresh
        if not same_dir and not auto_fresh:
            run.check_usable()
        resume = _load_resume(cfg)
        run.check_writable("--resume" if same_dir else "--out")
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    started = source.start(args, cfg, run)
    if isinstance(started, int):
        return started
    agents, membership = started
    import os
    # torch's C++ store logs a warning for every client that vanishes: here that is a
    # preemption the coordinator handles and reports itself.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from bamboo.cluster import forkserver
    forkserver.start()  # imports torch in the background while this process does too
    from bamboo.cluster.coordinator import RunFailed, run_local
    from bamboo.progress import ProgressDisplay
    from bamboo.runlog import RunDirError
    display = ProgressDisplay(cfg.steps, enabled=not args.quiet)
    serve_error: Any = ()  # catches nothing unless --http (prometheus_client loads only then)
    if http is not None:
        from bamboo.cluster.http import HttpServeError
        serve_error = HttpServeError
    try:
        summary = run_local(cfg, run, display, crash, debug=args.debug,
                            check_replicas=args.check_replicas, resume=resume, agents=agents,
                            membership=membership, http=http)
    except serve_error as e:  # --http's address is taken or not this machine's
        if agents is not None:
            agents.close()
        if membership is not None:
            membership[0].close()
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
            print(json.dumps(e.summary, indent=2))
        return e.exit_code
    if not args.no_report:
        write_run_report(run.path, args.quiet)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        first, last = summary["losses"][0], summary["losses"][-1]
        print(f"done: {summary['steps_completed']} steps, loss {first:.4f} -> {last:.4f}, "
              f"{summary['throughput']:.1f} samples/s; run directory {run.path}", file=sys.stderr)
    return 0
