"""A job's configuration, importable without torch: every option declared once, and the plain
data it is checked against (model presets, the --data and --layer-costs file formats).
It imports nothing of bamboo but `bamboo.util`, save a user's own model that its presets
build to size it (.importlinter).

    bamboo.config.options    the declaration (`option()`) and what is derived from it
    bamboo.config.sections   the sections of a job, each option with its check
    bamboo.config.job        JobConfig: the sections together, `of`, `validate`
    bamboo.config.data       the checks that read --data and --layer-costs
    bamboo.config.calls      `MODULE:NAME(key=value)` text: --optimizer, --lr-schedule
    bamboo.config.objects    objects sent by value (cloudpickle), found again by their SHA-256
    bamboo.config.presets    what a --model name is, in numbers (the model presets)
    bamboo.config.token_dir  the format of a prepared token directory (--data DIR)
    bamboo.config.layer_costs  the format of a --layer-costs file
    bamboo.config.jobfile    YAML/TOML job files and `bamboo config --example`
    bamboo.config.join       `bamboo coordinator`'s side: where agents join, etcd
"""
from __future__ import annotations

from bamboo.config.job import SECTIONS, JobConfig, all_options, options_by_key
from bamboo.config.join import JOIN_PORT, JOIN_TIMEOUT_S
from bamboo.config.options import ConfigError
from bamboo.config.sections import (
                                    COMM_MODES,
                                    HEARTBEAT_S,
                                    PRECISIONS,
                                    REDUNDANCY_MODES,
                                    KillSpec,
                                    parse_kill,
)

__all__ = ["ConfigError", "JobConfig", "KillSpec", "parse_kill", "SECTIONS", "all_options",
           "options_by_key", "REDUNDANCY_MODES", "COMM_MODES", "PRECISIONS", "HEARTBEAT_S",
           "JOIN_PORT", "JOIN_TIMEOUT_S", "REJOIN_S", "SECTION_CLASSES"]

SECTION_CLASSES = tuple(SECTIONS.values())
"""The section dataclasses (registered for the agents' wire with JobConfig)."""

REJOIN_S = 300.0
"""How long an agent keeps trying to rejoin a coordinator that went away."""
