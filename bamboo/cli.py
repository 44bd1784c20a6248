"""The `bamboo` command: train, simulate.

    bamboo train --nodes 4 --stages 4 --steps 50          # a local 4-stage pipeline
    bamboo train --nodes 8 --stages 4 --json              # 2 pipelines, summary on stdout
    bamboo simulate --trace traces/p3.csv --json          # project a spot trace

Arguments are validated before torch is imported, so a user error costs a fraction
of a second and prints one line: what is wrong and how to fix it.
"""
from __future__ import annotations

import argparse
import errno
from pathlib import Path
import json
import sys
from typing import Any

from bamboo.argparsing import EXIT_USAGE, UsageParser
from bamboo.config import (HEARTBEAT_S, JOIN_PORT, JOIN_TIMEOUT_S, REJOIN_S, ConfigError,
                           JobConfig, parse_kill)
from bamboo.presets import PRESETS

__all__ = ["main"]


def _train_parser(given_only: bool = False) -> argparse.ArgumentParser:
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


_FIELDS = ("model", "nodes", "stages", "pipelines", "micro_batches", "micro_batch_size", "steps",
           "seed", "redundancy", "frc_offload", "comm", "precision", "exact",
           "activation_checkpointing", "data", "layer_costs", "eval_every", "eval_batches", "tensorboard",
           "wandb", "lr", "warmup_steps", "weight_decay", "grad_clip",
           "threads", "comm_timeout_s", "lease_s", "device", "trace", "time_scale", "max_nodes",
           "notice_s", "checkpoint_every", "recovery", "resume", "out", "keep_checkpoints",
           "checkpoint_dir")


_COORDINATOR_FLAGS = ("--bind", "--advertise", "--store-port", "--token-file", "--etcd",
                      "--join-timeout")


def coordinator_parser() -> argparse.ArgumentParser:
    """`bamboo coordinator`: the job's flags (as `bamboo train`) and where agents join."""
    p = _train_parser()
    p.prog = "bamboo coordinator"
    p.description = ("Run a job whose nodes are agents (bamboo agent) on other machines; "
                     "this process holds the store and takes every decision.")
    p.add_argument("--bind", default=f"127.0.0.1:{JOIN_PORT}", metavar="ADDR:PORT",
                   help=f"where agents join (default 127.0.0.1:{JOIN_PORT}; 0.0.0.0:PORT for "
                   f"other machines)")
    p.add_argument("--advertise", metavar="HOST",
                   help="the host name or address workers reach this machine's store at "
                   "(default: the --bind address, or with a wildcard bind the address each "
                   "agent joined on)")
    p.add_argument("--store-port", type=int, metavar="P",
                   help="the store's fixed port (default: the --bind port + 1)")
    p.add_argument("--token-file", metavar="PATH",
                   help="the job's join token: read from PATH if it exists (e.g. a mounted "
                   "secret), else generated and written there (mode 0600); default "
                   "RUN_DIR/join-token")
    p.add_argument("--etcd", metavar="URL",
                   help="keep membership in this etcd (v3, e.g. http://10.0.0.5:2379): "
                   "agents hold leases there, an expired lease is a lost node")
    p.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the job's --nodes agents before giving up with "
                   f"exit code 1 (default {JOIN_TIMEOUT_S:g})")
    return p


def agent_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="bamboo agent", description="Run one machine's workers for a job "
                    "whose coordinator (bamboo coordinator) listens at ADDR:PORT.")
    p.add_argument("--join", required=True, metavar="ADDR:PORT", help="the coordinator's --bind")
    p.add_argument("--token", help="the job's join token (printed by the coordinator)")
    p.add_argument("--token-file", help="a file holding the join token")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="worker processes on this machine, one per GPU (worker k uses GPU k; "
                   "default 1)")
    p.add_argument("--rejoin-s", type=float, default=REJOIN_S, metavar="S",
                   help=f"when the coordinator goes away, keep trying to rejoin it for this "
                   f"many seconds before exiting (default {REJOIN_S:g})")
    p.add_argument("--notices", default="", help="preemption notice sources to watch besides "
                   "SIGTERM: a comma list of aws, gcp, azure")
    p.add_argument("--metadata-url", help="base URL of the notice source's metadata endpoint")
    p.add_argument("--http", metavar="ADDR:PORT", help="serve /healthz there (for probes)")
    p.add_argument("--quiet", action="store_true")
    return p


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


def _write_report(path: Path, quiet: bool) -> None:
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


def train(argv: list[str], coordinator: bool = False) -> int:
    """`bamboo train`; with `coordinator`, `bamboo coordinator`: the same job, its nodes
    being agents that join over the network instead of local processes.

    Long because it is the command's whole sequence, each stage a guard that ends in one
    line and an exit code: parse, job file, checks without torch, resume, run directory,
    agents and etcd, then the run and its report."""
    prog = "bamboo coordinator" if coordinator else "bamboo train"
    parser = coordinator_parser() if coordinator else _train_parser()
    args = parser.parse_args(argv)
    if coordinator:  # the job's own flags, for a --config file's overrides
        own = _COORDINATOR_FLAGS
        argv = [a for i, a in enumerate(argv) if not a.startswith(own)
                and not (i > 0 and argv[i - 1] in own)]
    try:
        if coordinator:
            from bamboo.cluster.remote import parse_address
            try:
                bind = parse_address(args.bind, "--bind")
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if args.store_port is not None and not 0 < args.store_port < 65536:
                raise ConfigError(f"--store-port {args.store_port} is not a TCP port (1-65535)")
            if args.store_port is not None and args.store_port == bind[1]:
                raise ConfigError(f"--store-port {args.store_port} is the --bind port: the "
                                  f"store needs a port of its own (default: bind port + 1)")
            if not args.join_timeout > 0:
                raise ConfigError(f"--join-timeout must be > 0 seconds (got {args.join_timeout:g})")
            if args.advertise is not None and not args.advertise.strip():
                raise ConfigError("--advertise is empty: give the host name or address the "
                                  "agents reach this machine at")
        http = None
        if args.http is not None:
            from bamboo.cluster.remote import parse_address
            try:
                http = parse_address(args.http, "--http")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        cfg = _config(args, argv)
        if coordinator and (cfg.trace is not None or cfg.recovery != "redundancy"):
            raise ConfigError("--trace and --recovery checkpoint-restart need local workers: "
                              "use bamboo train")
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
    agents = membership = None
    if coordinator:
        from bamboo.cluster.remote import AgentListener, write_join_token
        run.path.mkdir(parents=True, exist_ok=True)
        token_file = Path(args.token_file) if args.token_file else run.path / "join-token"
        generated = not token_file.exists()
        if token_file.exists():
            token = token_file.read_text().strip()
            if len(token) < 16:
                print(f"{prog}: error: --token-file {token_file} holds a token of "
                      f"{len(token)} characters: use at least 16 (openssl rand -hex 32)",
                      file=sys.stderr)
                return EXIT_USAGE
        else:
            token = write_join_token(token_file)
        try:
            agents = AgentListener(bind, token, advertise=args.advertise,
                                   store_port=args.store_port, join_timeout_s=args.join_timeout)
        except OSError as e:
            print(f"{prog}: error: cannot listen on {args.bind} ({e.strerror or e}): choose "
                  f"another --bind", file=sys.stderr)
            return EXIT_USAGE
        if args.etcd:
            from bamboo.cluster.membership import EtcdMembership, MembershipError
            job = run.path.resolve().name
            try:
                membership = (EtcdMembership.host(args.etcd, token, job=job,
                                                  ttl_s=min(3.0, cfg.lease_s)), args.etcd, job)
            except MembershipError as e:
                agents.close()
                if generated:  # leave nothing behind for a job that never started
                    token_file.unlink(missing_ok=True)
                    if not any(run.path.iterdir()):
                        run.path.rmdir()
                print(f"{prog}: error: {e}", file=sys.stderr)
                return EXIT_USAGE
        if not args.token_file:
            print(f"join token: {token} (also in {token_file}, mode 0600)",
                  file=sys.stderr, flush=True)
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
            _write_report(run.path, args.quiet)
        if args.json:
            print(json.dumps(e.summary, indent=2))
        return e.exit_code
    if not args.no_report:
        _write_report(run.path, args.quiet)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        first, last = summary["losses"][0], summary["losses"][-1]
        print(f"done: {summary['steps_completed']} steps, loss {first:.4f} -> {last:.4f}, "
              f"{summary['throughput']:.1f} samples/s; run directory {run.path}", file=sys.stderr)
    return 0


def _coordinator(argv: list[str]) -> int:
    return train(argv, coordinator=True)


def _agent(argv: list[str]) -> int:
    args = agent_parser().parse_args(argv)
    from bamboo.cluster.agent import AgentOptions, run_agent
    from bamboo.cluster.remote import JoinError, parse_address
    try:
        address = parse_address(args.join, "--join")
        if (args.token is None) == (args.token_file is None):
            raise ValueError("give the join token with exactly one of --token or --token-file")
        token = args.token
        if args.token_file is not None:
            try:
                token = Path(args.token_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"--token-file {args.token_file}: {e.strerror or e}") from None
        if not 1 <= args.workers <= 256:
            raise ValueError(f"--workers must be between 1 and 256 (got {args.workers})")
        if args.rejoin_s < 0:
            raise ValueError(f"--rejoin-s must be >= 0 seconds (got {args.rejoin_s:g})")
        sources = [x for x in args.notices.split(",") if x]
        bad = [x for x in sources if x not in ("aws", "gcp", "azure", "sigterm")]
        if bad:
            raise ValueError(f"--notices: unknown source '{bad[0]}': choose from aws, gcp, azure")
        http = parse_address(args.http, "--http") if args.http else None
        say = (lambda text: None) if args.quiet else \
            (lambda text: print(f"bamboo agent: {text}", file=sys.stderr, flush=True))
        opts = AgentOptions(address=address, token=token, workers=args.workers,
                            rejoin_s=args.rejoin_s, notice_sources=sources,
                            metadata_url=args.metadata_url, say=say)
        server = _agent_health(http, opts) if http else None
        try:
            return run_agent(opts)
        finally:
            if server is not None:
                server.close()
    except (ValueError, JoinError) as e:
        print(f"bamboo agent: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _agent_health(http: tuple[str, int], opts: Any) -> Any:
    """/healthz for an agent's probes: healthy while the process runs its loop."""
    from bamboo.cluster.http import HealthServer, RunMetrics
    try:
        return HealthServer(http[0], http[1], metrics=RunMetrics(),
                            health=lambda: (True, {"status": "agent", "join": "%s:%d" % opts.address,
                                                   "workers": opts.workers}))
    except OSError as e:
        raise ValueError(f"cannot serve --http {http[0]}:{http[1]} ({e.strerror or e})") from None


def _simulate(argv: list[str]) -> int:
    from bamboo.sim.cli import main as simulate_main
    return simulate_main(argv)


def _lab(argv: list[str]) -> int:
    from bamboo.lab.cli import main as lab_main
    return lab_main(argv)


def _report(argv: list[str]) -> int:
    from bamboo.report import main as report_main
    return report_main(argv)


def _profile(argv: list[str]) -> int:
    from bamboo.profile import main as profile_main
    return profile_main(argv)


def _data(argv: list[str]) -> int:
    from bamboo.tokendata import main as data_main
    return data_main(argv)


def _export(argv: list[str]) -> int:
    from bamboo.export import main as export_main
    return export_main(argv)


def _config_command(argv: list[str]) -> int:
    p = UsageParser(prog="bamboo config", description="Job files for `bamboo train --config`.")
    p.add_argument("--example", action="store_true", help="print a commented example job file")
    args = p.parse_args(argv)
    if not args.example:
        p.error("nothing to do; use --example")
    from bamboo.configfile import example_config
    print(example_config(), end="")
    return 0


_COMMANDS = {"train": train, "simulate": _simulate, "report": _report, "config": _config_command,
             "profile": _profile, "coordinator": _coordinator, "agent": _agent, "lab": _lab,
             "data": _data, "export": _export}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bamboo {train,coordinator,agent,lab,data,simulate,report,config,profile,"
              "export} ...\n\n"
              "  train        train a model on a local cluster of worker processes\n"
              "  coordinator  run a job whose nodes are agents on other machines\n"
              "  agent        run one machine's workers for a coordinator (--join)\n"
              "  lab          a coordinator and agents on hosts made of network namespaces\n"
              "  data         tokenize text files for --data (data prepare FILE... --out DIR)\n"
              "  simulate     project throughput and cost of a spot trace\n"
              "  report       write the text summary and plots of a run directory\n"
              "  profile      measure a model's step costs here for `simulate --costs`\n"
              "  export       write a finished run's model as a Hugging Face directory\n"
              "  config       print an example job file (--example)", file=sys.stderr)
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
        print(f"bamboo: {_unexpected(e, argv[0])} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


def _unexpected(e: BaseException, command: str) -> str:
    """One line for an exception nobody handled: its type always, its message's first line
    when it has one, and what to do for the ones a user can act on."""
    kind = type(e).__name__
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if isinstance(e, MemoryError) or kind == "OutOfMemoryError":  # torch.cuda's is a RuntimeError
        what = f"{kind}: {text[:200]}" if text else kind
        hint = ("reduce --micro-batch-size or the model size, or spread it over more --stages"
                if command in ("train", "coordinator", "profile") else
                "free memory or give it a smaller input")
        return f"out of memory ({what}): {hint}"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = f": {e.filename}" if e.filename else ""
        return f"no space left on device ({kind}{where}): free some space or write elsewhere"
    if not text:
        return f"internal error: {kind} (it carries no message)"
    return f"internal error: {kind}: {text}"


if __name__ == "__main__":
    sys.exit(main())
