"""One validated description of a training job, importable without torch.

`JobConfig.validate()` checks every field once, where the job is built, and raises
ConfigError with one line that names the field and says what to change.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bamboo.presets import ModelPreset, preset, with_vocab

__all__ = ["ConfigError", "JobConfig", "KillSpec", "parse_kill", "REDUNDANCY_MODES", "COMM_MODES",
           "PRECISIONS",
           "HEARTBEAT_S", "JOIN_PORT", "JOIN_TIMEOUT_S", "REJOIN_S"]

REDUNDANCY_MODES = ("eager", "lazy", "off", "auto")
COMM_MODES = ("tagged", "strict")
PRECISIONS = ("fp32", "bf16")

HEARTBEAT_S = 0.5
"""Seconds between two heartbeats of a worker; a --lease must be longer than this."""

JOIN_PORT = 29400
"""The coordinator's default join port; its store listens on the next port, /metrics is
commonly the one after (docs/deploy.md lists them)."""
JOIN_TIMEOUT_S = 600.0
"""How long a coordinator waits for its first --nodes agents."""
REJOIN_S = 300.0
"""How long an agent keeps trying to rejoin a coordinator that went away."""


class ConfigError(ValueError):
    """A user error in the job's configuration; str() is the one line to show."""


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
                          f"e.g. --kill 0:2@5 (or 0:2@5+notice)")
    return KillSpec(int(m[1]), int(m[2]), int(m[3]), bool(m[4]))


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Everything a training run needs; defaults give the demo job."""

    model: str = "gpt2-tiny"
    """A preset name from `bamboo.presets.PRESETS`."""
    nodes: int = 4
    """Worker processes to start; nodes beyond pipelines x stages are standbys."""
    stages: int = 4
    """Pipeline stages P."""
    pipelines: int | None = None
    """Data-parallel pipelines D; defaults to nodes // stages."""
    micro_batches: int = 4
    """Micro-batches per pipeline per step at the start (M); the global batch is D x M."""
    micro_batch_size: int = 8
    """Samples per micro-batch (B)."""
    steps: int = 50
    seed: int = 0
    redundancy: str = "eager"
    """eager | lazy | off: how a node prepares to take over its successor's stage; auto:
    chosen at every generation from the preemption rate and the costs measured in the run."""
    frc_offload: bool = False
    """Keep what eager FRC saves for a later backward in CPU memory (bounds GPU memory)."""
    comm: str = "strict"
    """strict | tagged. strict (the default) keeps NCCL's rules on every backend: no tags (transfers between
    two nodes are matched by the order they are posted), exchanges in both directions as one
    batch, and every loss handled by dropping the process group and forming a new one among
    the survivors. tagged (gloo only) keeps transfers apart by tags on a group that outlives
    lost peers."""
    precision: str = "fp32"
    """fp32 | bf16: bf16 runs forward and backward under autocast with bf16 compute; weights,
    gradients and optimizer state stay fp32."""
    exact: bool = False
    """Accumulate and reduce gradients in float64 in pipeline order, so every layout gives
    the same bits (slower; the default accumulates in fp32 and reduces with one collective)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them."""
    data: str | None = None
    """A directory written by `bamboo data prepare` (token files; the model's vocabulary
    follows its tokenizer's), or a UTF-8 text file to train on as byte tokens; default: a
    synthetic language."""
    layer_costs: str | None = None
    """A file of measured seconds per layer (`bamboo profile --layers-only`): stages are cut
    by those instead of by parameter counts."""
    eval_every: int = 0
    """Every K steps (and after the last), the held-out loss on the val split; 0: never."""
    eval_batches: int = 8
    """Val micro-batches (of --micro-batch-size windows each) in one evaluation."""
    tensorboard: str | None = None
    """Write TensorBoard event files to this directory."""
    wandb: str | None = None
    """Log the same scalars to this Weights & Biases project (WANDB_MODE=offline works
    without network)."""
    lr: float = 3e-3
    warmup_steps: int = 5
    """Linear warm-up steps, then cosine decay to lr / 10 at the last step."""
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all stages) to this; 0 disables."""
    threads: int = 1
    """torch threads per worker process."""
    comm_timeout_s: float = 60.0
    """Timeout of every point-to-point and collective call."""
    lease_s: float = 10.0
    """A node whose heartbeat is older than this is fenced (SIGKILL) and handled as lost."""
    device: str = "auto"
    """auto | cpu | cuda (cuda uses NCCL, one GPU per local worker)."""
    kills: list[KillSpec] = field(default_factory=list)
    trace: str | None = None
    """A preemption trace to replay on the local cluster (Bamboo CSV, count rows, JSON rows)."""
    time_scale: float = 360.0
    """Trace seconds per wall second when replaying a trace."""
    max_nodes: int | None = None
    """At most this many workers alive at once (default: --nodes)."""
    notice_s: float | None = None
    """Preemption notice before each kill (trace removes and +notice kills), wall seconds."""
    checkpoint_every: int = 0
    """Save a durable checkpoint every K steps and on every preemption notice (0: never).
    Used only when no live node holds some layer any more."""
    recovery: str = "redundancy"
    """redundancy | checkpoint-restart. The second is the baseline Bamboo is measured
    against: every preemption restarts all workers from the last checkpoint (as torchrun
    does); it implies --redundancy off and needs --checkpoint-every."""
    resume: str | None = None
    """Continue the run whose directory (or checkpoints/ folder) this is; "auto": the --out
    directory's run when it has a whole checkpoint, else a fresh start."""
    keep_checkpoints: int = 2
    """Whole checkpoints kept; older ones are pruned after a newer one is published."""
    checkpoint_dir: str | None = None
    """Where the nodes write checkpoints and the final layers: an absolute path or a URL
    (fsspec: s3://..., gs://..., file:///...) that every machine reaches at the same
    address; None: RUN_DIR/checkpoints."""
    out: str | None = None
    """Run directory; default runs/<timestamp>."""

    @property
    def data_parallel(self) -> int:
        return self.pipelines if self.pipelines is not None else self.nodes // self.stages

    @property
    def global_micro_batches(self) -> int:
        return self.data_parallel * self.micro_batches

    @property
    def active_nodes(self) -> int:
        return self.data_parallel * self.stages

    def evaluates_at(self, step: int) -> bool:
        """Whether the held-out loss is taken after `step` steps: every --eval-every steps
        and after the last."""
        return self.eval_every > 0 and 0 < step <= self.steps and \
            (step % self.eval_every == 0 or step == self.steps)

    def model_preset(self) -> ModelPreset:
        """The model's preset, its vocabulary that of the --data directory when there is one
        (ValueError with one line when the model cannot take it)."""
        p = preset(self.model)
        if self.data is None or p.family == "cnn" or not Path(self.data).is_dir():
            return p
        from bamboo.tokendata import read_header
        return with_vocab(p, read_header(self.data).vocab_size)

    def validate(self) -> JobConfig:
        """Check every field; raise ConfigError with a one-line fix. (One check per field,
        in field order: long, but read top to bottom like the dataclass itself.)"""
        try:
            p = preset(self.model)
        except ValueError as e:  # presets name the model; say which flag gave it
            text = str(e)
            raise ConfigError("--" + text if text.startswith("model ") else f"--model: {text}") from None
        for name in ("nodes", "stages", "micro_batches", "micro_batch_size", "steps", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive integer (got {value})")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0 (got {self.seed})")
        if self.stages > p.layers:
            raise ConfigError(f"--stages {self.stages} is more than the {p.layers} layers of "
                              f"{self.model}: use --stages {p.layers} or fewer")
        if self.pipelines is not None and self.pipelines < 1:
            raise ConfigError(f"--pipelines must be a positive integer (got {self.pipelines})")
        if self.data_parallel < 1:
            raise ConfigError(f"--nodes {self.nodes} cannot hold one pipeline of "
                              f"{self.stages} stages: use --nodes {self.stages} or more")
        if self.active_nodes > self.nodes:
            raise ConfigError(
                f"--pipelines {self.data_parallel} x --stages {self.stages} needs "
                f"{self.active_nodes} nodes but --nodes is {self.nodes}: use --nodes "
                f"{self.active_nodes} or --pipelines {self.nodes // self.stages}")
        if self.redundancy not in REDUNDANCY_MODES:
            raise ConfigError(f"--redundancy '{self.redundancy}' is not one of "
                              f"{', '.join(REDUNDANCY_MODES)}")
        if self.comm not in COMM_MODES:
            raise ConfigError(f"--comm '{self.comm}' is not one of {', '.join(COMM_MODES)}")
        if self.comm == "tagged" and self.device == "cuda" and \
                os.environ.get("BAMBOO_BACKEND", "") != "gloo":
            raise ConfigError("--comm tagged needs gloo, and --device cuda uses NCCL, which has "
                              "no tags: use --comm strict (the default)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision '{self.precision}' is not one of "
                              f"{', '.join(PRECISIONS)}")
        if self.exact and self.precision != "fp32":
            raise ConfigError("--exact needs --precision fp32: bf16 compute is not bit-identical "
                              "across layouts")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device '{self.device}' is not one of auto, cpu, cuda")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be positive (got {self.lr}): e.g. --lr 3e-3")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be an integer >= 0 (got {self.warmup_steps})")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError(f"--weight-decay must be a number >= 0 (got {self.weight_decay}): "
                              f"0 disables it")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ConfigError(f"--grad-clip must be a number >= 0 (got {self.grad_clip}): "
                              f"0 disables clipping")
        if not (0 < self.lease_s <= 10):
            raise ConfigError(f"--lease must be in (0, 10] seconds (got {self.lease_s})")
        if self.lease_s <= HEARTBEAT_S:
            raise ConfigError(f"--lease {self.lease_s:g} s is not longer than a worker's "
                              f"heartbeat interval ({HEARTBEAT_S:g} s): live nodes would be "
                              f"fenced between two heartbeats; use --lease {4 * HEARTBEAT_S:g} "
                              f"or more (default 10)")
        if not (0 < self.comm_timeout_s <= 86400):
            raise ConfigError(f"--comm-timeout must be positive seconds, at most 86400 (a day) "
                              f"(got {self.comm_timeout_s})")
        if (self.time_scale is None or not (self.time_scale > 0)
                or not math.isfinite(self.time_scale)):
            raise ConfigError(f"--time-scale must be a positive number of trace seconds per "
                              f"wall second (got {self.time_scale})")
        if self.max_nodes is not None and (not isinstance(self.max_nodes, int)
                                           or self.max_nodes < self.nodes):
            raise ConfigError(f"--max-nodes must be an integer >= --nodes {self.nodes} "
                              f"(got {self.max_nodes})")
        if self.notice_s is not None and not (0 < self.notice_s <= 600):
            raise ConfigError(f"--notice-s must be in (0, 600] wall seconds (got {self.notice_s})")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be an integer >= 0 (got "
                              f"{self.checkpoint_every})")
        if self.recovery not in ("redundancy", "checkpoint-restart"):
            raise ConfigError(f"--recovery '{self.recovery}' is not one of redundancy, "
                              f"checkpoint-restart")
        if self.recovery == "checkpoint-restart" and (self.redundancy != "off"
                                                      or self.checkpoint_every < 1):
            raise ConfigError("--recovery checkpoint-restart needs --redundancy off and "
                              "--checkpoint-every K (K >= 1)")
        if self.trace is not None and Path(self.trace).is_dir():
            raise ConfigError(f"--trace '{self.trace}' is a directory: give a trace file "
                              f"(Bamboo CSV, count rows or JSON rows)")
        if self.trace is not None and not Path(self.trace).is_file():
            raise ConfigError(f"--trace file '{self.trace}' does not exist: give a trace file "
                              f"(Bamboo CSV, count rows or JSON rows)")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ConfigError(f"--keep-checkpoints must be an integer >= 1 (got "
                              f"{self.keep_checkpoints})")
        if self.checkpoint_dir is not None and not (
                re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(self.checkpoint_dir))
                or Path(self.checkpoint_dir).is_absolute()):
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir} must be an absolute path "
                              f"or a URL (e.g. s3://bucket/run): every machine writes there")
        if self.resume == "auto" and self.out is None:
            raise ConfigError("--resume auto needs --out DIR: the run directory to continue "
                              "(or to start)")
        if self.resume not in (None, "auto") and not Path(self.resume).exists():
            raise ConfigError(f"--resume '{self.resume}' does not exist: give the --out "
                              f"directory of a run that saved checkpoints")
        if self.resume not in (None, "auto") and not Path(self.resume).is_dir():
            raise ConfigError(f"--resume '{self.resume}' is not a directory: give the --out "
                              f"directory of a run that saved checkpoints")
        self._validate_out()
        self._validate_data(p.family)
        self._validate_eval_and_logging()
        self._validate_layer_costs(p.layers)
        self._validate_kills()
        return self

    def _validate_layer_costs(self, layers: int) -> None:
        if self.layer_costs is None:
            return
        from bamboo.pipeline.layer_costs import load_layer_costs
        try:
            costs = load_layer_costs(self.layer_costs)
        except ValueError as e:
            raise ConfigError(f"--layer-costs: {e}") from None
        if costs.model != self.model:
            raise ConfigError(f"--layer-costs {self.layer_costs} was measured for "
                              f"{costs.model}, not {self.model}: profile this model")
        if len(costs.layer_s) != layers:
            raise ConfigError(f"--layer-costs {self.layer_costs} has {len(costs.layer_s)} "
                              f"layers; {self.model} has {layers}: profile this model")

    def partition_costs(self, param_counts: list[int]) -> list[float]:
        """What stages are cut by: --layer-costs' seconds, else parameter counts."""
        if self.layer_costs is None:
            return [float(c) for c in param_counts]
        from bamboo.pipeline.layer_costs import load_layer_costs
        return load_layer_costs(self.layer_costs).layer_s

    def _validate_eval_and_logging(self) -> None:
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"--eval-every must be an integer >= 0 (got {self.eval_every}); "
                              f"0 evaluates never")
        if not isinstance(self.eval_batches, int) or not 1 <= self.eval_batches <= 4096:
            raise ConfigError(f"--eval-batches must be an integer from 1 to 4096 (got "
                              f"{self.eval_batches})")
        if self.tensorboard is not None:
            if Path(self.tensorboard).exists() and not Path(self.tensorboard).is_dir():
                raise ConfigError(f"--tensorboard {self.tensorboard} exists and is not a "
                                  f"directory: give a directory for the event files")
            if importlib.util.find_spec("tensorboard") is None:
                raise ConfigError("--tensorboard needs the tensorboard package: "
                                  "pip install tensorboard")
        if self.wandb is not None:
            if not re.fullmatch(r"[\w.-]{1,128}", self.wandb):
                raise ConfigError(f"--wandb '{self.wandb}' is not a project name: use letters, "
                                  f"digits, '-', '_' and '.'")
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("--wandb needs the wandb package: pip install wandb (set "
                                  "WANDB_MODE=offline to log without network)")

    @property
    def node_cap(self) -> int:
        return self.max_nodes if self.max_nodes is not None else self.nodes

    def _validate_out(self) -> None:
        if self.out is None:
            return
        path = Path(self.out)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--out {path} exists and is not a directory: choose another path")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError(f"--out {path}: {parent} is a file, not a directory: "
                                      f"choose another path")
                break

    def _validate_data(self, family: str) -> None:
        if self.data is None:
            return
        if family == "cnn":
            raise ConfigError(f"--data is for token models; {self.model} trains on synthetic images")
        path = Path(self.data)
        if path.is_dir():
            self._validate_token_dir()
            return
        if not path.is_file():
            raise ConfigError(f"--data file '{self.data}' does not exist: give a directory written "
                              f"by `bamboo data prepare` or a path to a UTF-8 text file")
        need = self.model_preset().context + 1
        size = path.stat().st_size
        if size < need:
            raise ConfigError(f"--data file '{self.data}' has {size} bytes; "
                              f"{self.model} needs at least {need}")
        if size < 2 * need:
            raise ConfigError(f"--data file '{self.data}' has {size} bytes; {self.model} needs "
                              f"at least {2 * need}: {need} to train on and {need} held out")

    def _validate_token_dir(self) -> None:
        from bamboo.tokendata import open_split, read_header
        try:
            header = read_header(self.data)
            p = self.model_preset()
        except ValueError as e:  # read_header's lines start with the directory's name
            raise ConfigError(f"--data {e}" if str(e).startswith("'") else
                              f"--data {self.data}: {e}") from None
        need = p.context + 1
        for split, count in header.tokens.items():
            if count < need:
                raise ConfigError(f"--data {self.data}: its {split} split has {count} tokens; "
                                  f"{self.model} needs at least {need} (context + 1): prepare "
                                  f"more text" + (" or a larger --val-fraction"
                                                  if split == "val" else ""))
            try:
                open_split(self.data, header, split)
            except ValueError as e:
                raise ConfigError(f"--data {self.data}: {e}") from None

    def _validate_kills(self) -> None:
        for k in self.kills:
            if k.notice and self.notice_s is None:
                raise ConfigError(f"--kill {k} needs --notice-s S: how many seconds the notice "
                                  f"comes before the kill")
            self.check_target("--kill", str(k), k)

    def check_target(self, flag: str, text: str, k: KillSpec) -> None:
        """A fault aimed at stage S of pipeline D in step K must name a node and a step."""
        if k.pipeline >= self.data_parallel or k.stage >= self.stages:
            raise ConfigError(f"{flag} {text} names no node: pipelines are "
                              f"0..{self.data_parallel - 1} and stages 0..{self.stages - 1}")
        if k.step >= self.steps:
            raise ConfigError(f"{flag} {text} is past the run's last step {self.steps - 1}")

    def summary_fields(self) -> dict:
        """The `config` object of summary.json."""
        return {"nodes": self.nodes, "stages": self.stages, "pipelines": self.data_parallel,
                "micro_batches": self.micro_batches, "micro_batch_size": self.micro_batch_size,
                "redundancy": self.redundancy, "frc_offload": self.frc_offload,
                "comm": self.comm, "precision": self.precision, "exact": self.exact,
                "activation_checkpointing": self.activation_checkpointing,
                "model": self.model, "seed": self.seed,
                "steps": self.steps,
                "data": str(Path(self.data).resolve()) if self.data is not None else None,
                "eval_every": self.eval_every,
                "eval_batches": self.eval_batches, "layer_costs": self.layer_costs,
                "trace": self.trace,
                "time_scale": self.time_scale, "max_nodes": self.node_cap,
                "notice_s": self.notice_s, "checkpoint_every": self.checkpoint_every,
                "recovery": self.recovery}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kills"] = [str(k) for k in self.kills]
        return d
