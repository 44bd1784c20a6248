"""The sections of a job: every option declared once, with the checks of its section.

Each section is a `kw_only, slots` dataclass; a field made with `option()` is an option
(flag, job-file key, summary field, check: see `bamboo.config.options`). A section's
`check(job)` holds the checks that need more than one value; what needs the whole job
(a model's layer count, a data file's size) is `JobConfig.validate()`'s.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from bamboo.config.calls import check_call
from bamboo.config.layout import SCHEDULE_NAMES, LayoutSection
from bamboo.config.metric_spec import check_metrics
from bamboo.config.modes import RedundancyMode
from bamboo.config.options import ConfigError, non_negative_int, option, positive_int

if TYPE_CHECKING:
    from bamboo.config.presets import CustomSizing, ModelPreset

__all__ = ["KillSpec", "parse_kill", "ModelSection", "DataSection", "LayoutSection",
           "TrainingSection", "RedundancySection", "RuntimeSection", "ClusterSection",
           "CheckpointSection", "EvaluationSection", "LoggingSection", "HEARTBEAT_S",
           "JobView", "SCHEDULE_NAMES", "REDUNDANCY_MODES", "COMM_MODES", "PRECISIONS", "DEVICES", "RECOVERIES"]

REDUNDANCY_MODES = ("eager", "lazy", "off", "reroute", "auto")  # RedundancyMode, in --help's order
COMM_MODES = ("strict", "tagged")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
RECOVERIES = ("redundancy", "checkpoint-restart")
PIN_CPUS = ("off", "auto")
FRC_PLACES = ("waits", "slot")

HEARTBEAT_S = 0.5
"""Seconds between two heartbeats of a worker; a --lease must be longer than this."""


@dataclass(frozen=True, slots=True)
class KillSpec:
    """`--kill D:S@K[+notice]`: preempt the holder of stage S of pipeline D in step K."""

    pipeline: int
    stage: int
    step: int
    notice: bool = False

    def __str__(self) -> str:
        return f"{self.pipeline}:{self.stage}@{self.step}" + ("+notice" if self.notice else "")


_KILL = re.compile(r"^(\d+):(\d+)@(\d+)(\+notice)?$")


def parse_kill(text: str) -> KillSpec:
    """Parse `D:S@K` or `D:S@K+notice`."""
    m = _KILL.match(text.strip())
    if not m:
        raise ConfigError(f"--kill '{text}' is malformed: write PIPELINE:STAGE@STEP, "
                          f"e.g. --kill 0:2@5 (or 0:2@5+notice)", "kills")
    return KillSpec(int(m[1]), int(m[2]), int(m[3]), bool(m[4]))


def _number(low: float, *, above: bool, hint: str = "") -> Any:
    def check(value: Any) -> str | None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and (value > low if above else value >= low)
        return None if ok else f"must be a number {'>' if above else '>='} {low:g} (got {value}){hint}"
    return check


def _in_range(low: float, high: float, unit: str) -> Any:
    def check(value: Any) -> str | None:
        return None if low < value <= high else f"must be in ({low:g}, {high:g}] {unit} (got {value})"
    return check


def _absolute_or_url(value: str) -> str | None:
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) or Path(value).is_absolute():
        return None
    return f"{value} must be an absolute path or a URL (e.g. s3://bucket/run): every machine writes there"


def _model_help() -> str:
    from bamboo.config.presets import PRESETS
    return (f"A preset ({', '.join(PRESETS)}); or a Hugging Face model: hf:gpt2, hf:llama, "
            f"hf:bert, hf:gpt2:n_layer=4,n_embd=128, hf:DIR; or your own model: "
            f"MODULE:FUNCTION or FILE.py:FUNCTION (docs/models.md).")


@dataclass(kw_only=True, slots=True)
class ModelSection:
    """What is trained, and in what arithmetic."""

    name: str = option("gpt2-tiny", key="model", help=_model_help())
    precision: str = option("fp32", choices=PRECISIONS, help="""fp32 | bf16 | fp16: bf16 and
        fp16 run forward and backward under autocast with half-precision compute; weights,
        gradients and optimizer state stay fp32. fp16 (V100, T4: GPUs without bf16) scales
        the loss dynamically, as torch.amp.GradScaler does; a step whose gradients overflow
        is skipped on every node.""")
    activation_checkpointing: bool = option(False, help="""Recompute each layer's activations in
        the backward instead of keeping them.""")

    def check(self, job: JobView) -> None:
        if self.activation_checkpointing and job.layout.schedule == "zb-h1":
            raise ConfigError("--activation-checkpointing works with --schedule 1f1b only: "
                              "zb-h1 keeps the linear layers' inputs for their weight "
                              "gradients, which checkpointing would recompute",
                              "activation_checkpointing", "schedule")
        if job.training.exact and self.precision != "fp32":
            raise ConfigError(f"--exact needs --precision fp32: {self.precision} compute is "
                              f"not bit-identical across layouts", "exact", "precision")


@dataclass(kw_only=True, slots=True)
class DataSection:
    """What it is trained on."""

    path: str | None = option(None, key="data", metavar="DIR|FILE", summary=lambda job: str(
        Path(job.data.path).resolve()) if job.data.path is not None else None, help="""A directory
        written by `bamboo data prepare` (token files; the model's vocabulary follows its
        tokenizer's), or a UTF-8 text file to train on as byte tokens; default: a synthetic
        language.""")
    dataset: str | None = option(None, check=check_call, metavar="MODULE:NAME(ARGS)", help="""Your
        own map-style torch Dataset instead: a function or class returning it, with keyword
        arguments; sample i is (inputs, labels); bamboo picks the indices by seed and step,
        shuffled epochs without repetition (docs/api.md).""")
    eval_dataset: str | None = option(None, check=check_call, metavar="MODULE:NAME(ARGS)",
                                      help="""The held-out Dataset for --eval-every (its
        micro-batches in order); with --dataset, no held-out loss without it.""")
    collate: str | None = option(None, check=check_call, metavar="MODULE:NAME", help="""How
        --dataset's samples make a micro-batch (default: torch's default_collate).""")

    def check(self, job: JobView) -> None:
        if self.path is not None and self.dataset is not None:
            raise ConfigError("--data and --dataset both name the training data: give one",
                              "data", "dataset")
        for key, value in (("eval_dataset", self.eval_dataset), ("collate", self.collate)):
            if value is not None and self.dataset is None:
                raise ConfigError(f"--{key.replace('_', '-')} goes with --dataset: give "
                                  f"--dataset too (bamboo's own data has its own)", key)


def _lr(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
    return None if ok else f"must be positive (got {value}): e.g. --lr 3e-3"


def _seed(value: Any) -> str | None:
    return non_negative_int(value) and f"must be >= 0 (got {value})"


@dataclass(kw_only=True, slots=True)
class TrainingSection:
    """The optimisation: steps, seed, learning-rate schedule, gradient arithmetic."""

    steps: int = option(50, check=positive_int, help="Optimizer steps to run.")
    seed: int = option(0, check=_seed, help="Seeds the model's parameters and the data.")
    lr: float = option(3e-3, check=_lr, help="Peak learning rate (AdamW).")
    warmup_steps: int = option(5, check=non_negative_int, help="""Linear warm-up steps, then
        cosine decay to lr / 10 at the last step.""")
    weight_decay: float = option(0.01, check=_number(0, above=False, hint=": 0 disables it"),
                                 help="Decoupled weight decay on matrices.")
    grad_clip: float = option(1.0, check=_number(0, above=False, hint=": 0 disables clipping"),
                              help="""Clip the global gradient norm (over all stages) to this;
                              0 disables.""")
    exact: bool = option(False, help="""Accumulate and reduce gradients in float64 in pipeline
        order, so every layout gives the same bits (slower; the default accumulates in fp32 and
        reduces with one collective).""")
    optimizer: str | None = option(None, check=check_call, metavar="MODULE:NAME(ARGS)",
                                   help="""The optimizer instead of AdamW: a torch.optim
        class or a function of the parameters returning an optimizer, with keyword arguments,
        e.g. torch.optim:SGD(lr=0.05, momentum=0.9) (lr defaults to --lr; docs/api.md).""")
    lr_schedule: str | None = option(None, check=check_call, metavar="MODULE:NAME(ARGS)",
                                     help="""The learning-rate schedule instead of warm-up and
        cosine decay: a function step -> multiplier of the optimizer's learning rate, or a
        torch.optim.lr_scheduler class with its arguments, e.g.
        torch.optim.lr_scheduler:OneCycleLR(max_lr=0.1, total_steps=12).""")
    loss: str | None = option(None, check=check_call, metavar="MODULE:NAME(ARGS)", help="""The
        loss instead of the model's own: a function loss(outputs, labels) -> scalar mean loss
        of a micro-batch, or a class with its arguments, e.g.
        torch.nn:CrossEntropyLoss(label_smoothing=0.1).""")
    metrics: list[str] = option(factory=list, flag="--metric", metavar="NAME=MODULE:FUNCTION",
                                check=check_metrics, help="""A metric of the last stage
        (repeatable): FUNCTION(outputs, labels) -> scalar, averaged over the global batch
        (summary.json's metrics, the live line, TensorBoard, W&B, /metrics).""")

    def check(self, job: JobView) -> None:
        pass


@dataclass(kw_only=True, slots=True)
class RedundancySection:
    """How a lost node's work goes on: redundant computation, or the baselines."""

    mode: str = option("lazy", key="redundancy", choices=REDUNDANCY_MODES, help="""lazy |
        eager | off: how a node prepares to take over its successor's stage. lazy (the
        default) keeps its successor's layers and optimizer state, and redoes that stage's
        forwards only when it takes over; eager also runs them every step (free only where a
        pipeline bubble and a processor of its own hold them: M <= 3(P-1)); reroute (D >= 2):
        no replicas, a lost stage's micro-batches go to its data-parallel peers; auto: chosen
        at every generation from the preemption rate and the costs measured in the run.""")
    frc_at: str = option("waits", choices=FRC_PLACES, help="""waits | slot: where eager FRC
        runs. waits: while the node waits for a transfer, one redundant forward at a time,
        and what is left before the commit round; slot: right after its input is ready,
        whether the node would wait there or not.""")
    frc_offload: bool = option(False, help="""Keep what eager FRC saves for a later backward in
        CPU memory until a failover needs it (bounds GPU memory).""")
    recovery: str = option("redundancy", choices=RECOVERIES, help="""redundancy |
        checkpoint-restart. The second is the baseline Bamboo is measured against: every
        preemption restarts all workers from the last checkpoint (as torchrun does); it
        implies --redundancy off and needs checkpoints (not --checkpoint-every 0).""")
    check_replicas: bool = option(False, summary=False, help="""Compare every replica's digest
        with its primary's after every step.""")

    @property
    def kind(self) -> RedundancyMode:
        """`mode` as the type the run asks its questions of (the one place it is decoded)."""
        return RedundancyMode(self.mode)

    def check(self, job: JobView) -> None:
        if self.kind.reroutes and job.layout.data_parallel < 2:
            raise ConfigError(f"--redundancy reroute needs at least 2 pipelines (got "
                              f"{job.layout.data_parallel}): give --nodes at least twice "
                              f"--stages, or choose eager, lazy or off", "redundancy", "pipelines",
                              "nodes")
        if self.recovery == "checkpoint-restart" and (self.mode != "off"
                                                      or job.checkpoints.every == 0):
            raise ConfigError("--recovery checkpoint-restart needs --redundancy off and "
                              "checkpoints (--checkpoint-every K >= 1, or no --checkpoint-every)",
                              "recovery", "redundancy", "checkpoint_every")


def _bucket_mb(value: Any) -> str | None:
    return None if 0 <= value <= 1e6 else \
        f"must be megabytes between 0 (one bucket per stage) and 1000000 (got {value})"


def _comm_timeout(value: Any) -> str | None:
    return None if 0 < value <= 86400 else \
        f"must be positive seconds, at most 86400 (a day) (got {value})"


@dataclass(kw_only=True, slots=True)
class RuntimeSection:
    """Where and how each worker computes and communicates."""

    device: str = option("auto", choices=DEVICES, help="""auto | cpu | cuda (cuda uses NCCL,
        one GPU per local worker).""")
    threads: int = option(1, check=positive_int, help="torch threads per worker process.")
    pin_cpus: str = option("off", choices=PIN_CPUS, help="""off | auto: with auto, when this
        machine has at least as many cores as local workers, each local worker is pinned to
        cores of its own (os.sched_setaffinity) and its torch threads set to their number.""")
    comm: str = option("strict", choices=COMM_MODES, help="""strict | tagged. strict (the
        default) keeps NCCL's rules on every backend: no tags (transfers between two nodes are
        matched by the order they are posted), exchanges in both directions as one batch, and
        every loss handled by dropping the process group and forming a new one among the
        survivors. tagged (gloo only) keeps transfers apart by tags on a group that outlives
        lost peers.""")
    bucket_mb: float = option(25.0, flag="--bucket-mb", metavar="MB", check=_bucket_mb,
                              help="""The data-parallel gradient sums go in buckets of about
        this many MB (DDP's bucket_cap_mb), a stage's last layers first; in steady steps each
        is launched as soon as the stage's last backward of the step has produced it,
        overlapping the rest of that backward (zb-h1: after the last weight gradient; a
        re-routed stage: at the commit round); 0: one bucket per stage, at the round.""")
    comm_timeout_s: float = option(60.0, flag="--comm-timeout", metavar="S", check=_comm_timeout,
                                   help="Timeout of every point-to-point and collective call.")
    lease_s: float = option(10.0, flag="--lease", metavar="S",
                            check=_in_range(0, 10, "seconds"), help=f"""A node whose heartbeat
        is older than this is fenced (SIGKILL) and handled as lost; more than the
        {HEARTBEAT_S:g} s between two heartbeats.""")

    @property
    def step_stall_s(self) -> float:
        """How long the coordinator waits for any worker's news before it stops the run: a
        step must end (or a node report) within this."""
        return self.comm_timeout_s + 30.0

    def check(self, job: JobView) -> None:
        if self.comm == "tagged" and self.device == "cuda" and \
                os.environ.get("BAMBOO_BACKEND", "") != "gloo":
            raise ConfigError("--comm tagged needs gloo, and --device cuda uses NCCL, which has "
                              "no tags: use --comm strict (the default)", "comm", "device")
        if self.lease_s <= HEARTBEAT_S:
            raise ConfigError(f"--lease {self.lease_s:g} s is not longer than a worker's "
                              f"heartbeat interval ({HEARTBEAT_S:g} s): live nodes would be "
                              f"fenced between two heartbeats; use --lease {4 * HEARTBEAT_S:g} "
                              f"or more (default 10)", "lease_s")


DEFAULT_TIME_SCALE = 360.0
"""Trace seconds per wall second of a replay when --time-scale is not given."""


def _time_scale(value: Any) -> str | None:
    ok = value is None or (isinstance(value, (int, float)) and value > 0 and math.isfinite(value))
    return None if ok else f"must be a positive number of trace seconds per wall second (got {value})"


def _trace_file(value: str) -> str | None:
    what = "give a trace file (Bamboo CSV, count rows or JSON rows)"
    if Path(value).is_dir():
        return f"'{value}' is a directory: {what}"
    if not Path(value).is_file():
        return f"file '{value}' does not exist: {what}"
    return None


@dataclass(kw_only=True, slots=True)
class ClusterSection:
    """The local cluster's preemptions: injected kills, a replayed trace, notices."""

    kills: list[KillSpec] = option(factory=list, flag="--kill", metavar="D:S@K[+notice]",
                                   help="""Preemptions to inject (repeatable): "D:S@K" SIGKILLs
        the holder of stage S of pipeline D in step K; "D:S@K+notice" sends a notice (SIGTERM)
        first.""")
    trace: str | None = option(None, check=_trace_file, metavar="FILE", help="""A preemption
        trace to replay on the local cluster (Bamboo CSV, count rows, JSON rows).""")
    time_scale: float | None = option(None, check=_time_scale, help=f"""Trace seconds per wall
        second when replaying a --trace (default {DEFAULT_TIME_SCALE:g}).""")
    max_nodes: int | None = option(None, summary=lambda job: job.node_cap, help="""At most this
        many workers alive at once (default: --nodes).""")
    boot_s: float = option(0.0, check=_number(0, above=False), metavar="S", help="""Trace
        seconds a new instance takes to boot: when a slot under --max-nodes frees, a live trace
        node without a worker takes it this long after (EC2 takes about 45-90 s; 0: at once).""")
    notice_s: float | None = option(None, check=_in_range(0, 600, "wall seconds"), metavar="S",
                                    help="""Preemption notice before each kill (trace removes
        and +notice kills), wall seconds.""")

    @property
    def replay_time_scale(self) -> float:
        """The trace seconds per wall second a replay runs at."""
        return DEFAULT_TIME_SCALE if self.time_scale is None else self.time_scale

    def check(self, job: JobView) -> None:
        nodes = job.layout.nodes
        if self.time_scale is not None and self.trace is None:
            raise ConfigError(f"--time-scale {self.time_scale:g} has no trace to scale: add "
                              f"--trace FILE, or drop --time-scale", "time_scale", "trace")
        if self.max_nodes is not None and (not isinstance(self.max_nodes, int)
                                           or self.max_nodes < nodes):
            raise ConfigError(f"--max-nodes must be an integer >= --nodes {nodes} "
                              f"(got {self.max_nodes})", "max_nodes", "nodes")
        for k in self.kills:
            if k.notice and self.notice_s is None:
                raise ConfigError(f"--kill {k} needs --notice-s S: how many seconds the notice "
                                  f"comes before the kill", "kills", "notice_s")
            job.check_target("--kill", str(k), k)


def _resume(value: str) -> str | None:
    if value == "auto":
        return None
    if not Path(value).exists():
        return f"'{value}' does not exist: give the --out directory of a run that saved checkpoints"
    if not Path(value).is_dir():
        return f"'{value}' is not a directory: give the --out directory of a run that saved checkpoints"
    return None


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    """Durable checkpoints: how often, where, how many, and a run to continue."""

    every: int | None = option(None, key="checkpoint_every", check=non_negative_int,
                               metavar="K", help="""Save a durable checkpoint every K steps,
        on every preemption notice and after the last step (0: never). Default: chosen by the
        run: the first after step 2, then every sqrt(2 x write cost x mean time between losses
        no redundancy covers) (Young/Daly), at most 1% of step time spent writing and never
        more than 3 minutes of training unprotected. Used only when no live node holds some
        layer any more, and by --resume.""")
    dir: str | None = option(None, key="checkpoint_dir", check=_absolute_or_url,
                             metavar="PATH|URL", help="""Where the nodes write checkpoints and
        the final layers: an absolute path or a URL (fsspec: s3://..., gs://..., file:///...)
        that every machine reaches at the same address; default RUN_DIR/checkpoints.""")
    keep: int = option(2, key="keep_checkpoints", check=lambda v: positive_int(v) and
                       f"must be an integer >= 1 (got {v})", help="""Whole checkpoints kept;
        older ones are pruned after a newer one is published.""")
    resume: str | None = option(None, check=_resume, metavar="DIR|auto", help="""Continue the run
        whose directory (or checkpoints/ folder) this is; auto: the --out directory's run when
        it has a whole checkpoint, else a fresh start (one command line for the first start
        and every restart).""")

    def check(self, job: JobView) -> None:
        if self.resume == "auto" and job.logging.out is None:
            raise ConfigError("--resume auto needs --out DIR: the run directory to continue "
                              "(or to start)", "resume", "out")


def _eval_batches(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096
    return None if ok else f"must be an integer from 1 to 4096 (got {value})"


@dataclass(kw_only=True, slots=True)
class EvaluationSection:
    """The held-out loss."""

    every: int = option(0, key="eval_every", metavar="K", check=lambda v: non_negative_int(v) and
                        f"must be an integer >= 0 (got {v}); 0 evaluates never", help="""Every
        K steps (and after the last), the held-out loss on the val split (eval_losses in
        summary.json); 0: never.""")
    batches: int = option(8, key="eval_batches", metavar="N", check=_eval_batches, help="""Val
        micro-batches (of --micro-batch-size windows each) in one evaluation.""")

    def check(self, job: JobView) -> None:
        pass


def _tensorboard(value: str) -> str | None:
    if Path(value).exists() and not Path(value).is_dir():
        return f"{value} exists and is not a directory: give a directory for the event files"
    if importlib.util.find_spec("tensorboard") is None:
        return "needs the tensorboard package: pip install tensorboard"
    return None


def _wandb(value: str) -> str | None:
    if not re.fullmatch(r"[\w.-]{1,128}", value):
        return f"'{value}' is not a project name: use letters, digits, '-', '_' and '.'"
    if importlib.util.find_spec("wandb") is None:
        return ("needs the wandb package: pip install wandb (set WANDB_MODE=offline to log "
                "without network)")
    return None


def _out(value: str) -> str | None:
    path = Path(value)
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory: choose another path"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{path}: {parent} is a file, not a directory: choose another path"
            break
    return None


@dataclass(kw_only=True, slots=True)
class LoggingSection:
    """Where the run writes: its directory, TensorBoard, Weights & Biases."""

    out: str | None = option(None, check=_out, metavar="DIR", summary=False, help="""Run
        directory (summary.json, events.jsonl, report, checkpoints); default runs/<timestamp>.""")
    tensorboard: str | None = option(None, check=_tensorboard, metavar="DIR", help="""Write
        TensorBoard event files to this directory (tensorboard --logdir DIR).""")
    wandb: str | None = option(None, check=_wandb, metavar="PROJECT", help="""Log the same
        scalars to this Weights & Biases project (WANDB_MODE=offline works without
        network).""")

    def check(self, job: JobView) -> None:
        pass


class JobView(Protocol):
    """What the checks read of the whole job (`bamboo.config.JobConfig` is the one job),
    declared here so the sections need not import the job made of them."""

    model: ModelSection
    data: DataSection
    layout: LayoutSection
    training: TrainingSection
    checkpoints: CheckpointSection
    logging: LoggingSection

    @property
    def data_parallel(self) -> int: ...

    @property
    def node_cap(self) -> int: ...

    def model_preset(self, sizing: CustomSizing | None = None) -> ModelPreset: ...

    def check_target(self, flag: str, text: str, k: KillSpec) -> None: ...
