"""The simulator's models (`SimModel`, `SIM_MODELS`): per-layout step times and recovery costs the
policies are driven by (a `bamboo train` model preset is another thing: `bamboo.config.presets`).

GPT-2 and BERT step times are the Bamboo authors' measured seconds per step on
p3.2xlarge (12 stages; see traces/README.md). ResNet, VGG, GNMT and
AlexNet step times are the figures found in the authors' public simulator source;
they were not re-measured and are illustrative. Every recovery cost below is an
assumption stated in docs/simulator.md; ``--costs FILE`` replaces them with figures
profiled on our own engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .costs import StepCosts

__all__ = ["SimModel", "SIM_MODELS", "get_preset", "preset_from_costs"]


@dataclass(kw_only=True, slots=True, frozen=True)
class SimModel:
    """What the simulator needs to know about one model."""

    name: str
    stages: int
    """P: pipeline depth the step times were measured with."""
    step_s: dict[int, float]
    """Seconds per global step with D pipelines (RC on, as Bamboo runs; at one stage there is
    no RC to run), by D."""
    samples_per_step: int
    """Global batch: samples per step, the same for every D."""
    rc_overhead: float = 0.10
    """Fraction of a step that eager RC adds; a run without RC takes step_s / (1 + rc_overhead)."""
    lazy_overhead: float = 0.03
    """Fraction of a step that lazy RC (replicas kept in sync, no eager FRC) adds."""
    shadow_slowdown: float = 1.5
    """Step-time factor while a shadow node carries two stages."""
    failover_pause_s: float = 1.0
    """Extra wall time of one failover (detection, merging the schedules)."""
    rebalance_s: float = 20.0
    """Wall time of one reconfiguration among live nodes (local rendezvous)."""
    restart_s: float = 30.0
    """Wall time of a global restart after a fatal failure (global rendezvous)."""
    ckpt_save_s: float = 11.5
    """Seconds to write one durable checkpoint (training paused)."""
    ckpt_restart_s: float = 71.5
    """Seconds to restart every worker from a checkpoint (rendezvous + load)."""
    heal_s: float = 45.0
    """torchft: seconds from a replacement's readiness until its group is back in the quorum
    (start-up, joining, the state sent from a peer)."""
    quorum_s: float = 2.0
    """torchft: extra seconds a step loses when a group fails in it (error, a new quorum)."""
    on_demand_nodes: int = 32
    """The authors' on-demand reference cluster size."""
    on_demand_step_s: float = 3.37
    """The authors' on-demand reference seconds per step."""
    source: str = ""
    """Where the step times come from."""
    measured: bool = False
    """True when the step times are measured figures (not illustrative)."""

    @property
    def max_pipelines(self) -> int:
        return max(self.step_s)

    def step_time(self, pipelines: int) -> float:
        """Seconds per step with RC for D pipelines (D above the table uses the largest D)."""
        return self.step_s[min(pipelines, self.max_pipelines)]

    def plain_step_time(self, pipelines: int) -> float:
        """Seconds per step for D pipelines without any redundancy."""
        if self.stages == 1:
            return self.step_time(pipelines)  # no replica, no FRC at one stage
        return self.step_time(pipelines) / (1.0 + self.rc_overhead)


_AUTHORS_SIM = "step times from the Bamboo authors' public simulator source (illustrative, not re-measured)"

SIM_MODELS: dict[str, SimModel] = {
    "gpt2": SimModel(
        name="gpt2", stages=12, samples_per_step=32,
        step_s={4: 1.008, 3: 1.046, 2: 1.085, 1: 1.200},
        rebalance_s=20.0, restart_s=30.0, ckpt_save_s=11.5, ckpt_restart_s=71.5,
        on_demand_nodes=32, on_demand_step_s=3.37,
        source="Bamboo authors' measured step times (traces README)", measured=True,
    ),
    "bert": SimModel(
        name="bert", stages=12, samples_per_step=264,
        step_s={4: 1.450, 3: 1.805, 2: 2.390, 1: 4.310},
        rebalance_s=20.0, restart_s=30.0, ckpt_save_s=15.8, ckpt_restart_s=60.2,
        on_demand_nodes=20, on_demand_step_s=2.51,
        source="Bamboo authors' measured step times (traces README)", measured=True,
    ),
    "llama1b": SimModel(
        name="llama-1b", stages=8, samples_per_step=16,
        step_s={4: 1.512, 3: 1.569, 2: 1.628, 1: 1.800},
        rebalance_s=20.0, restart_s=30.0, ckpt_save_s=11.5, ckpt_restart_s=71.5,
        on_demand_nodes=32, on_demand_step_s=5.055,
        source="illustrative: GPT-2's measured step times x 12/8 (Llama-3.2-1B sizes, 1.5B "
               "parameters with the untied head, on 8 stages; 16 x 2048 tokens per step, as "
               "GPT-2's 32 x 1024)",
    ),
    "resnet": SimModel(
        name="resnet", stages=8, samples_per_step=384,
        step_s={4: 1.6, 3: 2.4, 2: 3.2, 1: 6.1},
        rebalance_s=10.0, restart_s=30.0, ckpt_save_s=10.0, ckpt_restart_s=60.0,
        on_demand_nodes=20, on_demand_step_s=1.3, source=_AUTHORS_SIM,
    ),
    "vgg": SimModel(
        name="vgg", stages=6, samples_per_step=384,
        step_s={4: 2.75, 3: 3.44, 2: 4.9, 1: 9.3},
        rebalance_s=5.0, restart_s=30.0, ckpt_save_s=10.0, ckpt_restart_s=60.0,
        on_demand_nodes=16, on_demand_step_s=2.2, source=_AUTHORS_SIM,
    ),
    "gnmt": SimModel(
        name="gnmt", stages=6, samples_per_step=288,
        step_s={4: 0.95, 3: 1.185, 2: 1.66, 1: 3.1},
        rebalance_s=10.0, restart_s=30.0, ckpt_save_s=10.0, ckpt_restart_s=60.0,
        on_demand_nodes=16, on_demand_step_s=0.9, source=_AUTHORS_SIM,
    ),
    "alexnet": SimModel(
        name="alexnet", stages=6, samples_per_step=384,
        step_s={4: 1.55, 3: 2.0, 2: 3.1, 1: 6.18},
        rebalance_s=5.0, restart_s=30.0, ckpt_save_s=10.0, ckpt_restart_s=60.0,
        on_demand_nodes=16, on_demand_step_s=1.6, source=_AUTHORS_SIM,
    ),
}


def get_preset(name: str) -> SimModel:
    """Look a preset up by name (case-insensitive, '-' ignored)."""
    key = name.lower().replace("-", "")
    if key not in SIM_MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(SIM_MODELS)}")
    return SIM_MODELS[key]


def preset_from_costs(costs: StepCosts, base: SimModel) -> SimModel:
    """A preset whose step times and recovery costs come from a profiled costs file."""
    step_s = {d: costs.step_time(d) * (1.0 + costs.rc_overhead) for d in range(1, costs.max_pipelines + 1)}
    return replace(
        base,
        name=costs.model or base.name,
        stages=costs.stages,
        samples_per_step=costs.samples_per_step,
        step_s=step_s,
        rc_overhead=costs.rc_overhead,
        failover_pause_s=costs.failover_pause_s,
        rebalance_s=costs.reconfiguration_s,
        restart_s=costs.restart_s if costs.restart_s is not None else costs.reconfiguration_s,
        ckpt_save_s=costs.checkpoint_save_s if costs.checkpoint_save_s is not None else base.ckpt_save_s,
        ckpt_restart_s=costs.restart_s if costs.restart_s is not None else base.ckpt_restart_s,
        on_demand_nodes=costs.stages * costs.max_pipelines,
        on_demand_step_s=costs.step_time(costs.max_pipelines),
        source="profiled costs file",
        measured=True,
    )
