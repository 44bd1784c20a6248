"""The layout section of a job: nodes, pipelines, stages and how a step's samples are cut.

The global batch (samples per step) is the unit every later layout keeps. It is given as
`--micro-batches M` per pipeline (G = D x M micro-batches of B samples), or as
`--global-batch-size S`, which sets M to S / (D x B). `--stages auto` leaves P, D and M to
the planner (`bamboo.plan.layout_choice`, run by `bamboo.model.layout_fit` before any worker
starts): until then the section holds "auto" and only the checks that need no P run.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal

from bamboo.config.options import ConfigError, option, positive_int

__all__ = ["LayoutSection", "ChosenStages", "SCHEDULE_NAMES", "AUTO", "parse_size"]

SCHEDULE_NAMES = ("1f1b", "zb-h1")
AUTO = "auto"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?)B?|B)?\s*$", re.IGNORECASE)


class ChosenStages(int):
    """A stage count --stages auto chose: an int everywhere, and summary.json's config says
    `stages_auto: true` for it."""

    __slots__ = ()


def parse_size(text: str) -> int:
    """Bytes of `64MiB`, `16GiB`, `2G` (binary), `500MB` (decimal) or `1048576`; ValueError
    for anything else."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(text)
    power = " KMGT".index(m[2].upper()) if m[2] else 0
    base = 1000 if m[2] and not m[3] and text.strip().upper().endswith("B") else 1024
    return int(float(m[1]) * base ** power)


def _size(value: Any) -> str | None:
    try:
        ok = isinstance(value, str) and parse_size(value) > 0
    except ValueError:
        ok = False
    return None if ok else f"'{value}' is not a size: write e.g. 64MiB, 16GiB or 500MB"


def _stages(value: Any) -> str | None:
    if value == AUTO:
        return None
    return positive_int(value) and f"must be a positive integer or auto (got {value})"


def _nearest(samples: int, unit: int) -> str:
    """The valid sizes around `samples` for a step cut in `unit`s."""
    low = samples // unit * unit
    return f"{low} or {low + unit}" if low else f"{unit}"


@dataclass(kw_only=True, slots=True)
class LayoutSection:
    """How the nodes form pipelines, and how a step is cut into micro-batches."""

    nodes: int = option(4, check=positive_int, help="""Worker processes to start; nodes beyond
        pipelines x stages are standbys.""")
    stages: int | Literal["auto"] = option(4, check=_stages, metavar="P|auto", help="""Pipeline
        stages P; auto: the fewest whose stage fits a node's memory (with its replica where
        the redundancy mode keeps one), with as many pipelines as the nodes and the global
        batch allow (the choice and why on stderr).""")
    pipelines: int | None = option(None, check=positive_int,
                                   summary=lambda job: job.data_parallel, help="""Data-parallel pipelines D;
        default nodes // stages.""")
    micro_batches: int = option(4, check=positive_int, help="""Micro-batches per pipeline per
        step at the start (M); the global batch is D x M; with --global-batch-size, S / (D x B).""")
    micro_batch_size: int = option(8, check=positive_int, help="Samples per micro-batch (B).")
    global_batch_size: int | None = option(
        None, check=positive_int, metavar="S",
        summary=lambda job: job.global_micro_batches * job.layout.micro_batch_size, help="""Samples
        per step, kept by every later layout: sets --micro-batches to S / (D x B); with
        --stages auto the layout is chosen for it (default there: --micro-batches x
        --micro-batch-size).""")
    memory_per_node: str | None = option(None, check=_size, metavar="SIZE", help="""The memory
        one node may use, e.g. 64MiB or 16GiB: --stages auto picks the fewest stages whose
        share of the model fits it; default this machine's memory shared by its local
        workers.""")
    host_memory_per_node: str | None = option(None, check=_size, metavar="SIZE", help="""The
        host memory one node may use for what it keeps off its accelerator (lazy
        redundancy's replica): with it --stages auto counts that replica against it, not
        against --memory-per-node; default on a GPU this machine's memory shared by its
        local workers; on CPU nodes the two are one memory, so both count against
        --memory-per-node.""")
    layer_costs: str | None = option(None, metavar="FILE", help="""A file of measured seconds
        per layer (`bamboo profile --layers-only`): stages are cut by those instead of by
        parameter counts.""")
    schedule: str = option("1f1b", choices=SCHEDULE_NAMES, help="""1f1b | zb-h1: the pipeline
        schedule. zb-h1 splits each backward into the input gradient and the weight gradient
        and defers the weight gradients into what 1F1B leaves idle (Zero Bubble, ICLR'24),
        with at most 1F1B's peak of micro-batches in flight on every stage; each linear
        layer's input is kept until its weight gradient.""")
    @property
    def data_parallel(self) -> int:
        if self.pipelines is not None:
            return self.pipelines
        return self.nodes // self.stages if isinstance(self.stages, int) else 1

    @property
    def stage_count(self) -> int:
        """P as a number: --stages auto is resolved (`ChosenStages`) before anything counts
        stages."""
        if isinstance(self.stages, int):
            return self.stages
        raise ConfigError("--stages auto has not chosen a stage count yet", "stages")

    @property
    def stages_auto(self) -> bool:
        """Whether --stages auto chose this layout's P."""
        return isinstance(self.stages, ChosenStages)

    @property
    def batch_samples(self) -> int:
        """The global batch in samples: --global-batch-size, else D x M x B."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.data_parallel * self.micro_batches * self.micro_batch_size

    def following_global_batch(self) -> LayoutSection:
        """This layout with M = S / (D x B) where --global-batch-size S sets it (unchanged
        where S is not given or does not divide: the check says why)."""
        values = (self.nodes, self.stages, self.micro_batch_size, self.global_batch_size)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values) \
                or not (self.pipelines is None or isinstance(self.pipelines, int)):
            return self
        unit = self.data_parallel * self.micro_batch_size
        s = self.global_batch_size
        if s is None or unit < 1 or s % unit:
            return self
        return dataclasses.replace(self, micro_batches=s // unit)

    def check(self, job: object) -> None:
        """The checks of the layout alone (`job`: the whole job, `sections.JobView`)."""
        if self.stages == AUTO:
            self._check_auto()
            return
        if self.data_parallel < 1:
            raise ConfigError(f"--nodes {self.nodes} cannot hold one pipeline of "
                              f"{self.stages} stages: use --nodes {self.stages} or more",
                              "nodes", "stages")
        stages = self.stage_count
        if self.data_parallel * stages > self.nodes:
            raise ConfigError(
                f"--pipelines {self.data_parallel} x --stages {stages} needs "
                f"{self.data_parallel * stages} nodes but --nodes is {self.nodes}: use "
                f"--nodes {self.data_parallel * stages} or --pipelines "
                f"{self.nodes // stages}", "pipelines", "stages", "nodes")
        self._check_global_batch()

    def _check_global_batch(self) -> None:
        s, b, d, m = (self.global_batch_size, self.micro_batch_size, self.data_parallel,
                      self.micro_batches)
        if s is None:
            return
        if s % (d * b):
            raise ConfigError(f"--global-batch-size {s} is not a multiple of {d} pipelines x "
                              f"{b} samples (--micro-batch-size): use --global-batch-size "
                              f"{_nearest(s, d * b)}", "global_batch_size")
        if m != s // (d * b):
            raise ConfigError(f"--micro-batches {m} makes {d * m * b} samples a step, not "
                              f"--global-batch-size {s}: drop --micro-batches (S sets it to "
                              f"{s // (d * b)})", "micro_batches", "global_batch_size")

    def _check_auto(self) -> None:
        if self.pipelines is not None:
            raise ConfigError(f"--stages auto chooses the pipelines too: drop --pipelines "
                              f"{self.pipelines}, or give --stages P", "pipelines", "stages")
        s, b = self.batch_samples, self.micro_batch_size
        if s % b:
            raise ConfigError(f"--global-batch-size {s} is not a multiple of --micro-batch-size "
                              f"{b}: use --global-batch-size {_nearest(s, b)}",
                              "global_batch_size")
