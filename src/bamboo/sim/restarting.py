"""What the bamboo and checkpoint policies share: a layout of P-stage pipelines formed at a
rendezvous, standbys, and losses that a standby or an ongoing rendezvous simply absorbs; their
statuses and timer kinds."""
from __future__ import annotations

from bamboo.sim.core import RESTART, ClusterPolicy

__all__ = ["RestartingPolicy", "STOPPED", "RDV", "RUNNING", "SAVING", "T_RDV_DONE", "T_DECIDE",
           "T_FALLBACK", "T_CKPT_START", "T_CKPT_DONE", "T_MORPH", "T_RESUME"]

# statuses
STOPPED, RDV, RUNNING, SAVING = 0, 1, 2, 3
# timer kinds
T_RDV_DONE, T_DECIDE, T_FALLBACK, T_CKPT_START, T_CKPT_DONE, T_MORPH, T_RESUME = range(7)


class RestartingPolicy(ClusterPolicy):
    """What bamboo and checkpoint share: a layout of P-stage pipelines formed at a rendezvous,
    standbys, and losses that a standby or an ongoing rendezvous simply absorbs."""

    def _reset(self) -> None:
        super()._reset()
        self.P = self.preset.stages
        self.status = STOPPED
        self.D = 0
        self.standby: dict[int, None] = {}
        self.members: set[int] = set()
        self.broken = False
        self.rdv_mode = RESTART
        self.started = False

    def _loss_absorbed(self, node: int) -> bool:
        """True when losing `node` changes nothing running: it was a standby, or a member
        of a rendezvous under way (which then has to start over)."""
        if node in self.standby:
            del self.standby[node]
            self.bump("standby_losses")
            return True
        if self.status == RDV:
            if node in self.members:
                self.members.discard(node)
                self.broken = True
            return True
        return False
