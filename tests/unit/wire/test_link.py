"""A worker's link to the coordinator over a real TCPStore: votes are answered, and a vote
made moot by a newer role epoch is settled at once instead of waiting out the timeout."""
from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from multiprocessing import Pipe

import pytest
import torch.distributed as dist

from bamboo.plan.roles import RoleMap
from bamboo.protocol.messages import (
    BoundaryFlag,
    Decision,
    Go,
    MicroBatchesDone,
    RoundDone,
    StepReport,
    Verdict,
    decide_key,
    epoch_key,
    go_key,
)
from bamboo.wire.link import CoordinatorGone, CoordinatorLink


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    yield master


def link_for(store, timeout_s: float = 5.0) -> tuple[CoordinatorLink, object]:
    reader, writer = Pipe(duplex=False)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           timeout=timedelta(seconds=10))
    watch = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                          timeout=timedelta(seconds=10))
    return CoordinatorLink(rank=3, conn=writer, store=client, timeout_s=timeout_s,
                           watch_store=watch), reader


def publish_epoch(store, epoch: int) -> None:
    roles = RoleMap.initial(stages=2, pipelines=1, redundancy=True)
    roles.epoch = epoch
    store.set(epoch_key(epoch), roles.to_json())


@pytest.mark.timeout(30)
def test_a_vote_gets_the_coordinators_answer(store) -> None:
    link, reader = link_for(store)
    store.set(go_key(4, 0), Go.GO.value)
    assert link.phase_a_done(4, 0) is Go.GO
    sent = reader.recv()
    assert sent == MicroBatchesDone(rank=3, step=4, epoch=0)
    store.set(decide_key(4, 0), Verdict(Decision.COMMIT, frozenset({BoundaryFlag.CHECKPOINT}))
              .encode())
    verdict = link.round_done(4, 0, True, [(0, 1.5, 0.25)])
    assert verdict == Verdict(Decision.COMMIT, frozenset({BoundaryFlag.CHECKPOINT}))
    assert isinstance(reader.recv(), RoundDone)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("vote", ["go", "decide"])
def test_a_vote_made_moot_by_a_newer_epoch_returns_at_once(store, vote: str) -> None:
    """The coordinator never answers an old epoch's vote with anything but abort/redo
    once a newer epoch exists, so the link does not wait out its 20 s timeout."""
    link, _ = link_for(store, timeout_s=20)
    answers: list = []
    call = (lambda: link.phase_a_done(7, 0)) if vote == "go" else \
        (lambda: link.round_done(7, 0, True, []))
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    start = time.monotonic()
    thread.start()
    time.sleep(0.3)
    assert not answers  # still waiting: nothing was decided
    publish_epoch(store, 1)
    thread.join(10)
    assert time.monotonic() - start < 5
    expected = Go.ABORT if vote == "go" else Verdict(Decision.REDO)
    assert answers == [expected]


@pytest.mark.timeout(30)
def test_an_answer_given_before_the_new_epoch_wins(store) -> None:
    """COMMIT written before the epoch changed stays COMMIT (compare-and-set, not set)."""
    link, _ = link_for(store)
    store.set(decide_key(2, 0), "commit")
    publish_epoch(store, 1)
    time.sleep(0.3)
    assert link.round_done(2, 0, True, []) == Verdict(Decision.COMMIT)


@pytest.mark.timeout(30)
def test_no_answer_and_no_new_epoch_is_coordinator_gone(store) -> None:
    link, _ = link_for(store, timeout_s=1)
    with pytest.raises(CoordinatorGone, match="go/9/0"):
        link.phase_a_done(9, 0)


def test_messages_survive_pickling() -> None:
    """What an agent relays: every message is plain data, equal after a round trip."""
    report = StepReport(rank=1, step=3, stages=[1], losses=[(0, 1.0, 0.5)], digests={"a": "b"})
    assert pickle.loads(pickle.dumps(report)) == report


@pytest.mark.timeout(60)
def test_an_abandoned_group_formation_does_not_hold_up_the_node(store) -> None:
    """A generation abandoned while its process group forms (a member never connects):
    the node gives it up at once, and its next store calls (the next plan, its votes) are
    not stuck behind the formation, which waits in the store until its own timeout."""
    from multiprocessing.sharedctypes import RawArray

    import torch

    from bamboo.config import JobConfig
    from bamboo.node.worker import TransferFailed, WorkerNode
    from bamboo.plan.planner import GenerationPlan
    from bamboo.protocol.launch import WorkerSpec
    from bamboo.protocol.messages import Progress

    cfg = JobConfig.of(nodes=2, stages=2, steps=2, comm_timeout_s=30).validate()
    spec = WorkerSpec(node=0, slot=0, first_gen=0, store_host="127.0.0.1",
                      store_port=store.port, config=cfg)
    link, _ = link_for(store)
    progress = Progress(RawArray("d", [0.0]), RawArray("i", [0, 0]))
    node = WorkerNode(spec, link, link.store, torch.device("cpu"), "gloo", progress)
    plan = GenerationPlan(gen=3, epoch=0, members=["n0", "n1"], pipelines=1, stages=2,
                          parts=[[0, 4], [4, 8]], start_step=0)
    threading.Timer(0.5, publish_epoch, args=(store, 1)).start()  # the coordinator abandons
    start = time.monotonic()
    with pytest.raises(TransferFailed, match="abandoned"):
        node.join_group(plan, 0)  # n1 never connects
    assert time.monotonic() - start < 5
    start = time.monotonic()
    store.set("gen/4", "x")
    assert node.store.check(["gen/4"]) and node.store.get("gen/4") == b"x"
    assert time.monotonic() - start < 2
