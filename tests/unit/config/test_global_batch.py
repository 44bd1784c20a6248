"""`--global-batch-size S` and `--stages auto` as options: one declaration for the flags, the
job file and bamboo.Job; M = S / (D x B); the layout --stages auto resolves to, and how
summary.json's config shows it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.config import ConfigError, JobConfig, parse_kill
from bamboo.config.layout import parse_size


def test_the_global_batch_sets_the_micro_batches_and_follows_the_layout() -> None:
    cfg = JobConfig.of(nodes=4, stages=2, global_batch_size=96).validate()
    assert (cfg.data_parallel, cfg.layout.micro_batches, cfg.global_micro_batches) == (2, 6, 12)
    wider = cfg.replace(nodes=8).validate()  # S is kept: more pipelines, fewer micro-batches
    assert (wider.data_parallel, wider.layout.micro_batches) == (4, 3)
    assert wider.summary_fields()["global_batch_size"] == 96
    agreed = JobConfig.of(nodes=4, stages=2, global_batch_size=96, micro_batches=6).validate()
    assert agreed.layout.micro_batches == 6
    # without S the summary still says the samples a step: D x M x B
    assert JobConfig.of(nodes=4, stages=2).validate().summary_fields()["global_batch_size"] == 64


@pytest.mark.parametrize("values,expected", [
    (dict(nodes=4, stages=2, global_batch_size=60), "--global-batch-size 60 is not a multiple "
     "of 2 pipelines x 8 samples (--micro-batch-size): use --global-batch-size 48 or 64"),
    (dict(nodes=4, stages=2, global_batch_size=8), "use --global-batch-size 16"),
    (dict(nodes=4, stages=2, global_batch_size=96, micro_batches=4), "--micro-batches 4 makes "
     "64 samples a step, not --global-batch-size 96: drop --micro-batches (S sets it to 6)"),
    (dict(stages="auto", pipelines=2), "--stages auto chooses the pipelines too"),
    (dict(stages="auto", global_batch_size=20), "is not a multiple of --micro-batch-size 8: "
     "use --global-batch-size 16 or 24"),
    (dict(stages="some"), "--stages must be a positive integer or auto (got some)"),
    (dict(memory_per_node="a lot"), "--memory-per-node 'a lot' is not a size"),
])
def test_refusals_are_one_line(values: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        JobConfig.of(**values).validate()
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_sizes() -> None:
    assert [parse_size(t) for t in ("64MiB", "2G", "1.5 KiB", "500MB", "4096", "1kb")] == \
        [64 * 2**20, 2 * 2**30, 1536, 500 * 10**6, 4096, 1000]
    with pytest.raises(ValueError):
        parse_size("64 apples")


def test_flags_file_and_api_take_auto_and_the_global_batch(tmp_path: Path) -> None:
    from bamboo import Job
    from bamboo.cli.train import job_config, train_parser
    from bamboo.config.jobfile import load_job_config
    argv = ["--stages", "auto", "--global-batch-size", "64", "--memory-per-node", "64MiB"]
    cfg = job_config(train_parser().parse_args(argv), argv, train_parser(given_only=True))
    assert (cfg.layout.stages, cfg.layout.global_batch_size) == ("auto", 64)
    argv = ["--nodes", "4", "--stages", "2", "--global-batch-size", "64"]  # M from S, not 4
    cfg = job_config(train_parser().parse_args(argv), argv, train_parser(given_only=True))
    assert (cfg.layout.stages, cfg.layout.micro_batches) == (2, 4)
    argv = ["--nodes", "4", "--stages", "4", "--global-batch-size", "16"]
    cfg = job_config(train_parser().parse_args(argv), argv, train_parser(given_only=True))
    assert cfg.layout.micro_batches == 2
    job = tmp_path / "job.yaml"
    job.write_text("layout: {stages: auto, global_batch_size: 32}\n")
    assert load_job_config(job).layout.stages == "auto"
    job.write_text("layout: {nodes: 2, stages: 1, global-batch-size: 32}\n")
    assert load_job_config(job).layout.micro_batches == 2
    assert Job(stages="auto", global_batch_size=64).config.layout.stages == "auto"
    assert Job(nodes=2, stages=2, global_batch_size=24).config.layout.micro_batches == 3


def test_auto_resolves_to_a_whole_job_whose_summary_says_so() -> None:
    from bamboo.model.fits import node_memory_lower_bound
    from bamboo.model.layout_fit import resolve_stages
    auto = JobConfig.of(nodes=4, stages="auto", global_batch_size=64, memory_per_node="64MiB",
                        redundancy="eager", kills=[parse_kill("3:0@2")]).validate()
    cfg, line = resolve_stages(auto, 4)
    assert (cfg.layout.stages, cfg.data_parallel, cfg.layout.micro_batches) == (1, 4, 2)
    assert line.startswith("--stages auto: 1 stage x 4 pipelines, 2 micro-batches of 8 (")
    assert "fit --memory-per-node 64MiB at P=1" in line and "\n" not in line
    config = json.loads(json.dumps(cfg.summary_fields()))
    assert (config["stages"], config["pipelines"], config["micro_batches"]) == (1, 4, 2)
    assert config["stages_auto"] is True and config["global_batch_size"] == 64
    assert JobConfig.of().validate().summary_fields()["stages_auto"] is False
    # a tighter cap: the smallest P whose stage and its replica fit, by the fit check's bound
    tight = auto.replace(memory_per_node="5MiB", kills=[])
    cfg, line = resolve_stages(tight, 4)
    assert (cfg.layout.stages, cfg.data_parallel, cfg.layout.micro_batches) == (4, 1, 8)
    assert node_memory_lower_bound(cfg).total <= 5 * 2**20 < node_memory_lower_bound(
        cfg.replace(stages=3, pipelines=1)).total
    with pytest.raises(ConfigError, match="no layout of gpt2-tiny fits --memory-per-node 1MiB"):
        resolve_stages(tight.replace(memory_per_node="1MiB"), 4)
    fixed = JobConfig.of(nodes=4, stages=2).validate()
    assert resolve_stages(fixed, 4) == (fixed, None)


def test_a_kill_is_checked_against_the_chosen_layout() -> None:
    from bamboo.model.layout_fit import resolve_stages
    auto = JobConfig.of(nodes=4, stages="auto", global_batch_size=64, memory_per_node="6MiB",
                        kills=[parse_kill("3:0@2")]).validate()  # checked once P is chosen
    with pytest.raises(ConfigError, match="--kill 3:0@2 names no node: pipelines are 0..0"):
        resolve_stages(auto, 4)


@pytest.mark.parametrize("mode,stages,micro_batches", [
    ("eager", 2, 4), ("lazy", 4, 8), ("auto", 3, 2), ("off", 2, 1), ("reroute", 2, 3)])
def test_the_planner_counts_a_node_as_the_fit_check_does(mode: str, stages: int,
                                                         micro_batches: int) -> None:
    """The planner's bound is the fit check's (`bamboo.model.fits`), so a layout it picks is
    never one the check refuses; off and reroute count no replica."""
    from bamboo.config.modes import RedundancyMode
    from bamboo.model.fits import node_memory_lower_bound
    from bamboo.model.layout_fit import footprint
    from bamboo.plan.layout_choice import node_need
    keeps_replica = RedundancyMode(mode).may_keep_replica
    cfg = JobConfig.of(nodes=8, stages=stages, pipelines=2, micro_batches=micro_batches,
                       redundancy=mode).validate()
    need, bound = node_need(footprint(cfg), stages, micro_batches, keeps_replica), \
        node_memory_lower_bound(cfg)
    assert (bound.state_bytes > node_need(footprint(cfg), stages, micro_batches,
                                          False).state_bytes) == keeps_replica
    assert (need.state_bytes, need.activation_bytes, need.schedule_bytes) == \
        (bound.state_bytes, bound.activation_bytes, bound.schedule_bytes)


def test_auto_cuts_stages_by_the_layer_costs_given(tmp_path: Path) -> None:
    from bamboo.model.layout_fit import footprint, resolve_stages
    from support.costs import write_layer_costs
    costs = write_layer_costs(tmp_path / "c.json", layer_s=[1.0] * 5 + [5.0] * 3)
    auto = JobConfig.of(stages="auto", layer_costs=str(costs), memory_per_node="64MiB").validate()
    assert footprint(auto).layer_costs == (1.0,) * 5 + (5.0,) * 3
    by_params = footprint(auto.replace(layer_costs=None)).layer_costs
    assert by_params[0] > by_params[1] > 0  # the embedding's layer holds the most parameters
    assert resolve_stages(auto, 4)[0].layout.layer_costs == str(costs)
    with pytest.raises(ConfigError, match="layer"):  # a file of another model is refused
        footprint(auto.replace(layer_costs=str(write_layer_costs(tmp_path / "d.json",
                                                                 layer_s=[1.0] * 3))))
