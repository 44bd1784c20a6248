"""From a validated job to a running one: the checks before any worker starts, and the run.

One sequence for `bamboo train`, `bamboo coordinator`, `bamboo.train` and `bamboo.Trainer`,
`launch`: `--stages auto` resolved, the job's fit on its nodes, the trace parsed, `--resume
auto` resolved, the run directory checked (a finished run is never overwritten), the
checkpoint to continue loaded and checked against the job; then the run in this process
(`execute`). Each check raises ConfigError with one line; `prog` names the caller in warnings
and notes, `interface` says in its user's words what to do next.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bamboo.config import ConfigError, JobConfig
from bamboo.run.interface import Interface
from bamboo.run.runlog import RunDir, default_run_dir
from bamboo.util.logs import by

if TYPE_CHECKING:
    from collections.abc import Callable

    from bamboo.protocol.launch import Launcher
    from bamboo.run.progress import ProgressDisplay

__all__ = ["Start", "launch", "launcher_for", "execute", "warm_up", "check_optimizer", "check_trace",
           "check_same_job"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Start:
    """A job ready to run: its config (resume resolved), run directory and checkpoint."""

    cfg: JobConfig
    run: RunDir
    resume: Any
    """The checkpoint to continue from (`bamboo.run.checkpoint.Checkpoint`), or None."""


def launch(cfg: JobConfig, prog: str, *, nodes_here: bool = True,
           check: Callable[[JobConfig], None] | None = None, run_dir: type[RunDir] = RunDir,
           interface: Interface = Interface.CLI) -> Start | None:
    """Every check of a job before it runs, and its run directory: the `Start` to run, or
    None when `--resume auto` finds its run already complete (nothing to do).

    `nodes_here`: the nodes are worker processes of this machine (their memory is its
    memory), else agents on others; `check`: the caller's own checks of the job as it will
    run (its layout chosen), before anything is written; `run_dir`: the RunDir class to make
    the directory with; `interface`: whose words say what to do next (`--resume auto`, or
    `resume="auto"`). ConfigError with one line."""
    from bamboo.data.sizing import SIZING
    from bamboo.model.fits import check_fits, check_step_length
    from bamboo.model.layout_fit import resolve_stages
    nodes_here = nodes_here and cfg.ray.address is None
    cfg, chosen = resolve_stages(cfg, cfg.node_cap, SIZING)  # --stages auto: P, D and M
    if chosen is not None:
        log.info("%s", chosen, extra=by(prog))
    if not nodes_here and (cfg.cluster.trace is not None
                           or cfg.redundancy.recovery != "redundancy"):
        raise ConfigError("--trace and --recovery checkpoint-restart need local workers: use "
                          "bamboo train without --ray", "trace", "recovery", "ray")
    if nodes_here:  # the local workers share this machine's memory
        check_fits(cfg, cfg.node_cap, SIZING)
    check_step_length(cfg, nodes_here=nodes_here, sizing=SIZING)
    if check is not None:
        check(cfg)
    return _prepare(cfg, prog, run_dir, interface)


def _prepare(cfg: JobConfig, prog: str, run_dir: type[RunDir],
             interface: Interface) -> Start | None:
    """The checks of a job whose layout is settled, and its run directory (`launch`)."""
    check_trace(cfg, prog)
    check_optimizer(cfg)
    from bamboo.data.user import check_job_data
    check_job_data(cfg)
    auto_fresh = False
    if cfg.checkpoints.resume == "auto":
        resolved, auto_fresh = _resolve_auto_resume(cfg, prog, interface)
        if resolved is None:
            return None
        cfg = resolved
    run = run_dir(cfg.logging.out or cfg.checkpoints.resume or default_run_dir())
    resume_dir = cfg.checkpoints.resume
    same_dir = resume_dir is not None and run.path.resolve() == Path(resume_dir).resolve()
    run.restarting = auto_fresh
    if not same_dir and not auto_fresh:
        run.check_usable(interface)
    resume = _load_resume(cfg, prog)
    run.check_writable("--resume" if same_dir else "--out")
    _save_objects(cfg, run.path)
    return Start(cfg, run, resume)


def _save_objects(cfg: JobConfig, run_path: Path) -> None:
    """The job's objects sent by value written once into the run directory's objects/
    (`<sha256>.pkl`, the bytes every worker loads), where a later resume or report finds
    them too; and into this machine's directory, where its workers look (a resume on a
    machine that never held them, the bytes checked against their hash on the way)."""
    from bamboo.config import objects
    refs = objects.references(cfg.to_dict())
    for ref in refs:  # read once, checked, and kept in this process for save()
        objects.install(ref, objects.data_of(ref))
    if refs:
        objects.save(refs, run_path / "objects")


def launcher_for(start: Start, flag: str = "--ray") -> Launcher:
    """Where a job run from this machine (`bamboo train`, `bamboo.train`, `bamboo.Trainer`)
    runs its nodes: actors on the Ray cluster its `ray` option names, else local worker
    processes. LaunchError (one line, naming `flag`) when the cluster cannot be used."""
    if start.cfg.ray.address is not None:
        from bamboo.launch.on_ray import RayNodes
        return RayNodes.open(start.cfg, start.run.path, flag)
    from bamboo.launch.local import LocalWorkers
    return LocalWorkers()


def execute(start: Start, launcher: Launcher, display: ProgressDisplay, *,
            crash: dict[int, list] | None = None, debug: bool = False,
            http: tuple[str, int] | None = None,
            interface: Interface = Interface.CLI) -> dict[str, Any]:
    """Run the prepared job in this process (the coordinator) to its end: the summary, or
    RunFailed (`bamboo.control.run_job`), whose stop by the user says how to continue in
    the words of `interface`."""
    warm_up(debug)
    from bamboo.control import RunOptions, run_job
    return run_job(start.cfg, start.run, display, launcher,
                   RunOptions(extra_faults=crash or {}, debug=debug, resume=start.resume,
                              http=http, interface=interface))


def warm_up(debug: bool = False) -> None:
    """Start the fork server now: it imports torch in the background while this process
    imports it too (idempotent)."""
    # torch's C++ store logs a warning, and for a client that vanishes mid-handshake an
    # error ("Write setup to client failed ... EBADF"), for what is here a preemption the
    # coordinator handles and reports itself; debug shows its errors.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR" if debug else "FATAL")
    from bamboo.node import forkserver
    forkserver.start()


def check_optimizer(cfg: JobConfig) -> None:
    """Build the job's own optimizer and schedule here once (`--optimizer`,
    `--lr-schedule`), so a wrong one is one line before any worker starts."""
    t = cfg.training
    if t.optimizer is None and t.lr_schedule is None:
        return
    from bamboo.engine.optim import check_optimizer as build_once
    for flag, optimizer, schedule in (("--optimizer", t.optimizer, None),
                                      ("--lr-schedule", t.optimizer, t.lr_schedule)):
        try:
            build_once(optimizer, schedule, t.lr, t.steps)
        except Exception as e:  # noqa: BLE001 - the user's code: any error is theirs to fix
            text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise ConfigError(f"{flag} {(schedule or optimizer)}: {text}".splitlines()[0][:300],
                              flag.lstrip("-").replace("-", "_")) from None


def check_trace(cfg: JobConfig, prog: str) -> None:
    """Parse the trace now, so a malformed row is a one-line error before anything starts."""
    if cfg.cluster.trace is None:
        return
    from bamboo.traces.trace import TraceError, load_trace
    try:
        trace = load_trace(cfg.cluster.trace)
    except TraceError as e:
        raise ConfigError(f"--trace: {e}") from None
    if trace.unsorted_rows:
        log.warning("%s: %d row(s) out of time order were sorted", cfg.cluster.trace,
                    trace.unsorted_rows, extra=by(prog))
    added = len({n for n, k in zip(trace.nodes, trace.kinds) if k == 1})
    if added < cfg.layout.nodes:
        raise ConfigError(f"--trace {cfg.cluster.trace} adds {added} distinct node(s) but --nodes is "
                          f"{cfg.layout.nodes}: the replay's initial workers are the trace's first "
                          f"--nodes adds; use --nodes {max(added, 1)} or a longer trace")


def _resolve_auto_resume(cfg: JobConfig, prog: str,
                         interface: Interface) -> tuple[JobConfig | None, bool]:
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
        check_same_job(cfg, done.get("config") or {},
                       f"{interface.resume_auto}: the run in {out}")
        completed = done.get("steps_completed")
        if done.get("status") == "completed" and isinstance(completed, int) and \
                completed >= cfg.training.steps:
            log.info("the run in %s already completed %d steps; nothing to do (pass %s, or "
                     "another %s for a new run)", out, completed, interface.steps(),
                     interface.out.strip(), extra=by(prog))
            return None, False
    from bamboo.run.checkpoint import CheckpointError, list_checkpoints, load_latest
    from bamboo.run.runlog import checkpoint_root
    root = cfg.checkpoints.dir or checkpoint_root(out)
    if list_checkpoints(root):
        try:
            load_latest(root, quiet=True)
            return cfg.replace(resume=str(out)), False
        except CheckpointError as e:  # every one unusable: say so, then start over
            log.warning("%s: %s; starting from step 0", interface.resume_auto, e, extra=by(prog))
    return cfg.replace(resume=None), out.exists()


_API_WORDS = {"--steps": "steps=", "--out": "out=", "--resume": "resume="}
"""What `bamboo.train`'s caller calls a flag named in a message."""


def _said(prog: str, flag: str) -> str:
    """`flag` in the words of the interface `prog` names (`bamboo.train`: its keyword)."""
    return _API_WORDS.get(flag, flag) if prog == "bamboo.train" else flag


def check_same_job(cfg: JobConfig, made_with: dict[str, Any], what: str) -> None:
    """ConfigError when `made_with` (a checkpoint's meta, or a run's summary config) names a
    model, seed or batch other than this job's: continuing it would train another run."""
    if "global_micro_batches" not in made_with and "pipelines" in made_with \
            and "micro_batches" in made_with:
        made_with = made_with | {"global_micro_batches":
                                 made_with["pipelines"] * made_with["micro_batches"]}
    _check_same_objects(cfg, made_with, what)
    for key, value in (("model", cfg.model.name), ("seed", cfg.training.seed),
                       ("global_micro_batches", cfg.global_micro_batches),
                       ("micro_batch_size", cfg.layout.micro_batch_size),
                       ("optimizer", cfg.training.optimizer)):  # its state fills the vector
        if key in made_with and made_with[key] != value:
            raise ConfigError(f"{what} was made with {key} {made_with[key]!r}, this job has "
                              f"{value!r}: use the same settings (or another --out for a new "
                              f"run)")


def _check_same_objects(cfg: JobConfig, made_with: dict[str, Any], what: str) -> None:
    """ConfigError when the run was made with a model sent by value and this job gives
    another one (their SHA-256 differ), or gives it otherwise."""
    from bamboo.config import objects
    before, now = made_with.get("model"), cfg.model.name
    if before == now or not (objects.is_reference(before) or objects.is_reference(now)):
        return

    def shown(name: Any) -> str:
        return objects.short(name) if objects.is_reference(name) else repr(name)
    raise ConfigError(f"{what} was made with the model {shown(before)}, this job gives "
                      f"{shown(now)}: resume with the same model object (the same bytes), or "
                      f"use another --out for a new run", "model")


def _load_resume(cfg: JobConfig, prog: str) -> Any:
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
    check_same_job(cfg, ckpt.meta, f"--resume {cfg.checkpoints.resume}: its checkpoint")
    from bamboo.data.user import check_resume_position
    check_resume_position(cfg, ckpt.meta, ckpt.step, f"--resume {cfg.checkpoints.resume}: its checkpoint")
    if ckpt.warning:
        log.warning("%s", ckpt.warning, extra=by(prog))
    steps = cfg.training.steps
    if ckpt.step > steps:
        raise ConfigError(f"--resume {cfg.checkpoints.resume}: its checkpoint is at step {ckpt.step}, "
                          f"{_said(prog, '--steps')} is {steps}: ask for {ckpt.step} steps or "
                          f"more", "steps")
    if ckpt.step == steps:  # stopped after its last step's checkpoint, before its model
        log.info("the checkpoint of step %d is the run's last: writing its model.pt and "
                 "summary.json from it (no step is run)", steps, extra=by(prog))
        return ckpt
    planned = ckpt.meta.get("steps")
    if isinstance(planned, int) and planned != cfg.training.steps:
        # The learning rate's cosine decay ends at --steps (bamboo.engine.optim).
        how = "stretched" if cfg.training.steps > planned else "shortened"
        log.info("note: resuming a run planned for %d steps with --steps %d: the learning-rate "
                 "schedule is %s to %d steps (pass --steps %d to keep it)", planned,
                 cfg.training.steps, how, cfg.training.steps, planned, extra=by(prog))
    return ckpt
