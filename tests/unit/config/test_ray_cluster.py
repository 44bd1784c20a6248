"""The Ray options of a job (`bamboo.config.ray_cluster`) and the names a Ray actor gives its
machine (`bamboo.node.ray_actor`): parsed, checked and read back without a cluster."""
from __future__ import annotations

import pytest

from bamboo.config import ConfigError, JobConfig
from bamboo.config.ray_cluster import parse_resources
from bamboo.node.ray_actor import machine_name, ray_node_of


def test_resources_parse_to_what_one_node_asks() -> None:
    assert parse_resources("CPU=1") == {"CPU": 1.0}
    assert parse_resources("CPU=4, GPU=1,spot=0.5") == {"CPU": 4.0, "GPU": 1.0, "spot": 0.5}


@pytest.mark.parametrize("text,said", [
    ("CPU", "'CPU' is not NAME=AMOUNT"), ("CPU=-1", "'CPU=-1' is not NAME=AMOUNT"),
    ("=1", "'=1' is not NAME=AMOUNT"), ("CPU=nan", "'CPU=nan' is not NAME=AMOUNT"),
    ("CPU=1,CPU=2", "names CPU twice"), ("CPU=0", "asks Ray for nothing")])
def test_wrong_resources_say_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_resources(text)


def test_the_section_reads_back_its_ask_and_refuses_options_without_an_address() -> None:
    cfg = JobConfig.of(ray="auto", ray_resources="CPU=2,GPU=1").validate()
    assert cfg.ray.address == "auto" and cfg.ray.resource_ask == {"CPU": 2.0, "GPU": 1.0}
    assert JobConfig.of(ray="10.0.0.1:6379").validate().ray.resource_ask is None
    with pytest.raises(ConfigError, match="--ray-resources applies to a run on Ray"):
        JobConfig.of(ray_resources="CPU=1").validate()
    with pytest.raises(ConfigError, match="Ray Client address"):
        JobConfig.of(ray="ray://head:10001").validate()


def test_an_actor_machine_name_carries_its_ray_node() -> None:
    node = "9d0ce76af609f9a43eeb1dd898d7a8e928b36d3f7f2142cc6482853b"
    assert ray_node_of(machine_name(node, 3)) == node
    assert machine_name(node, 3) != machine_name(node, 4)  # two actors on one Ray node
    assert ray_node_of("vm-1234") is None and ray_node_of(None) is None
