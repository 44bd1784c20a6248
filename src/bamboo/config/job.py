"""`JobConfig`: one validated description of a training job, in sections.

    cfg = JobConfig.of(nodes=4, stages=2, steps=20, redundancy="lazy").validate()
    cfg.layout.stages, cfg.training.steps, cfg.redundancy.mode

`JobConfig.of` takes every option by its flat key (the flag's name with `_`), so code and
tests that build a job need not know the sections; `replace` does the same for a copy.
`validate()` checks every option once (its section's declarations), then what needs more
than one section, and raises ConfigError with one line naming the flag and the fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from bamboo.config.options import (
    ConfigError,
    OptionField,
    check_section,
    flat_values,
    option_fields,
)
from bamboo.config.presets import (
    CustomSizing,
    ModelPreset,
    custom_preset,
    is_custom_name,
    preset,
    with_vocab,
)
from bamboo.config.ray_cluster import RaySection
from bamboo.config.sections import (
    CheckpointSection,
    ClusterSection,
    DataSection,
    EvaluationSection,
    KillSpec,
    LayoutSection,
    LoggingSection,
    ModelSection,
    RedundancySection,
    RuntimeSection,
    TrainingSection,
)

__all__ = ["JobConfig", "SECTIONS", "all_options", "options_by_key"]

SECTIONS: dict[str, type] = {
    "model": ModelSection, "data": DataSection, "layout": LayoutSection,
    "training": TrainingSection, "redundancy": RedundancySection, "runtime": RuntimeSection,
    "cluster": ClusterSection, "checkpoints": CheckpointSection,
    "evaluation": EvaluationSection, "logging": LoggingSection, "ray": RaySection,
}
"""Section name -> its class, in the order flags, files and the example show them."""


@cache
def all_options() -> tuple[OptionField, ...]:
    """Every option of a job, section by section, in declaration order."""
    return tuple(f for name, cls in SECTIONS.items() for f in option_fields(name, cls))


@cache
def options_by_key() -> dict[str, OptionField]:
    return {f.key: f for f in all_options()}


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Everything a training run needs; defaults give the demo job."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    redundancy: RedundancySection = field(default_factory=RedundancySection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    checkpoints: CheckpointSection = field(default_factory=CheckpointSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    ray: RaySection = field(default_factory=RaySection)

    # -- building -------------------------------------------------------------------------

    @classmethod
    def of(cls, **values: Any) -> JobConfig:
        """A job from options given by their flat keys (`nodes=4`, `checkpoint_every=5`)."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> JobConfig:
        """A copy with these options (by flat key) changed; TypeError for an unknown key."""
        by_key = options_by_key()
        unknown = sorted(set(values) - set(by_key))
        if unknown:
            raise TypeError(f"JobConfig has no option {', '.join(unknown)}")
        changes: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            f = by_key[key]
            changes.setdefault(f.section, {})[f.name] = value
        sections = {name: dataclasses.replace(getattr(self, name), **fields)
                    for name, fields in changes.items()}
        if "layout" in sections and "micro_batches" not in values:  # S / (D x B), S given
            sections["layout"] = sections["layout"].following_global_batch()
        return dataclasses.replace(self, **sections)

    # -- derived ---------------------------------------------------------------------------

    @property
    def data_parallel(self) -> int:
        return self.layout.data_parallel

    @property
    def global_micro_batches(self) -> int:
        return self.data_parallel * self.layout.micro_batches

    @property
    def active_nodes(self) -> int:
        return self.data_parallel * self.layout.stage_count

    @property
    def node_cap(self) -> int:
        max_nodes = self.cluster.max_nodes
        return max_nodes if max_nodes is not None else self.layout.nodes

    def evaluates_at(self, step: int) -> bool:
        """Whether the held-out loss is taken after `step` steps: every --eval-every steps
        and after the last."""
        every, steps = self.evaluation.every, self.training.steps
        return every > 0 and 0 < step <= steps and (step % every == 0 or step == steps)

    def model_preset(self, sizing: CustomSizing | None = None) -> ModelPreset:
        """The model's preset, its vocabulary that of the --data directory when there is one
        (ValueError with one line when the model cannot take it). Your own model is sized by
        `sizing` (this package builds no model)."""
        p = self._preset(sizing)
        data = self.data.path
        if data is None or p.family == "cnn" or not Path(data).is_dir():
            return p
        from bamboo.config.token_dir import read_header
        return with_vocab(p, read_header(data).vocab_size, sizing)

    def _preset(self, sizing: CustomSizing | None) -> ModelPreset:
        """The model's preset; your own model trained on a Dataset built for the inputs the
        Dataset's first sample hands it (`sizing.dataset_inputs`): its shapes come from the
        data."""
        name, d = self.model.name, self.data
        if d.dataset is None or not is_custom_name(name) or sizing is None:
            return preset(name, sizing)
        inputs = sizing.dataset_inputs(d.dataset, d.collate)  # ConfigError naming --dataset
        return custom_preset(name, None, inputs, sizing.model)

    def partition_costs(self, param_counts: list[int]) -> list[float]:
        """What stages are cut by: --layer-costs' seconds, else parameter counts."""
        if self.layout.layer_costs is None:
            return [float(c) for c in param_counts]
        from bamboo.config.layer_costs import load_layer_costs
        return load_layer_costs(self.layout.layer_costs).layer_s

    # -- checking --------------------------------------------------------------------------

    def validate(self, sizing: CustomSizing | None = None) -> JobConfig:
        """Check every option (its declaration), every section (what needs two options),
        then the job as a whole, your own model sized by `sizing` (`model_preset`); raise
        ConfigError with a one-line fix. The run directories
        the job names (`--resume`, `--out`) are searched for its objects sent by value from
        here on: a resume finds them there on a machine whose own copy is gone."""
        from bamboo.config import objects
        objects.add_run_dirs(self.checkpoints.resume, self.logging.out)
        try:
            p = self._preset(sizing)
        except ConfigError:
            raise
        except ValueError as e:  # presets name the model; say which flag gave it
            text = str(e)
            raise ConfigError("--" + text if text.startswith("model ") else f"--model: {text}",
                              "model") from None
        options = all_options()
        for name in SECTIONS:
            check_section(getattr(self, name), [f for f in options if f.section == name])
        if self.layout.stages == "auto":  # chosen, then checked whole: bamboo.model.layout_fit
            self.layout.check(self)
            return self
        if self.layout.stages > p.layers:
            raise ConfigError(f"--stages {self.layout.stages} is more than the {p.layers} "
                              f"layers of {self.model.name}: use --stages {p.layers} or fewer",
                              "stages")
        for name in SECTIONS:
            getattr(self, name).check(self)
        _check_byte_vocabulary(self, p)
        from bamboo.config.data import check_data, check_layer_costs
        check_data(self, p.family, sizing)
        check_layer_costs(self, p.layers)
        return self

    def check_target(self, flag: str, text: str, k: KillSpec) -> None:
        """A fault aimed at stage S of pipeline D in step K must name a node and a step."""
        key = "kills" if flag == "--kill" else flag.lstrip("-")
        if k.pipeline >= self.data_parallel or k.stage >= self.layout.stage_count:
            raise ConfigError(f"{flag} {text} names no node: pipelines are "
                              f"0..{self.data_parallel - 1} and stages "
                              f"0..{self.layout.stage_count - 1}", key)
        if k.step >= self.training.steps:
            raise ConfigError(f"{flag} {text} is past the run's last step "
                              f"{self.training.steps - 1}", key)

    # -- views -----------------------------------------------------------------------------

    def summary_fields(self) -> dict[str, Any]:
        """The `config` object of summary.json: every option its declaration puts there."""
        return {**flat_values(self, list(all_options()), summary=True),
                "stages_auto": self.layout.stages_auto}

    def to_dict(self) -> dict[str, Any]:
        """Every option by its flat key (the run_start event, W&B's run config)."""
        return flat_values(self, list(all_options()))



def _check_byte_vocabulary(job: JobConfig, p: ModelPreset) -> None:
    """Your model on bamboo's byte tokens (the synthetic language, a --data text file) needs
    ids 0..255; a --dataset brings its own inputs, and a --data directory sizes the model to
    its tokenizer (`model_preset`), so neither needs it."""
    path = job.data.path
    if (p.family != "custom" or p.vocab >= 256 or job.data.dataset is not None
            or (path is not None and Path(path).is_dir())):
        return
    has = (f"vocab_size={p.vocab} is too small for byte tokens 0..255" if p.vocab else
           "has no vocab_size, and byte tokens 0..255 need one")
    raise ConfigError(f"--model '{p.name}': {has} (the synthetic data and text files): give "
                      f"vocab_size a default of 256 or more, or train on a --dataset", "model")
