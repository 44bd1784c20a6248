"""The data-parallel sums in buckets (bamboo.engine.buckets): how a stage's gradient is cut,
and two members on a real gloo group (two threads of this process) whose buckets go out
from hooks during the backward and sum to the bits of the whole stage's sum. (Through real
runs with kills: tests/integration/test_buckets_runs.py.)"""
from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st_

from bamboo.config.presets import preset
from bamboo.engine.buckets import StageBuckets, group_name, plan_buckets
from bamboo.engine.comm import P2P
from bamboo.engine.stage import StageOptimizer, StageState
from support.gloo import gloo_options


@settings(max_examples=200, deadline=None)
@given(sizes=st_.lists(st_.integers(0, 50), max_size=12), cap=st_.integers(0, 400))
def test_buckets_cover_the_gradient_in_whole_parameters_from_the_last(
        sizes: list[int], cap: int) -> None:
    buckets = plan_buckets(sizes, 4, cap)
    total = sum(sizes)
    # launched in this order: from the end of the flat gradient to its start, contiguous
    assert buckets[-1][0] == 0 and buckets[0][1] == total
    for (a, b), (c, d) in zip(buckets, buckets[1:]):
        assert d == a and c <= d <= b
    edges = {0}
    for n in sizes:
        edges.add(max(edges) + n)
    assert all(a in edges and b in edges for a, b in buckets)  # whole parameters
    if cap == 0:
        assert buckets == [(0, total)]
    for a, b in buckets[:-1]:  # all but the last one launched hold at least the cap
        assert (b - a) * 4 >= cap > 0


def _stage(exact: bool) -> StageState:
    return StageState(preset=preset("gpt2-tiny"), stage=1, layer_indices=range(2, 4), seed=3,
                      device=torch.device("cpu"), optim=StageOptimizer(1e-2, 0.1),
                      accumulate_dtype=torch.float64 if exact else torch.float32)


def _backward(st: StageState, seed: int, before_last: Callable[[], None]) -> None:
    """Three micro-batches' gradients into the sum, as the engine adds them (`accumulate`
    after each backward), `before_last` called before the last one's."""
    gen = torch.Generator().manual_seed(seed)
    st.module.eval()  # no dropout: both sums see the same gradients
    d = preset("gpt2-tiny").d_model
    for mb in range(3):
        if mb == 2:
            before_last()
        st.module(torch.randn(2, 5, d, generator=gen)).square().mean().backward()
        st.accumulate()


def _on_two_members(body: Callable[[int, P2P], object], staged: bool) -> list[object]:
    """`body(rank, p2p)` on a 2-member gloo group, one thread each; each's result. `staged`:
    tensors go through host copies, as an accelerator's do on gloo."""
    store, results, errors = dist.HashStore(), [None, None], []

    def member(rank: int) -> None:
        def former(name: str, ranks: list[int]) -> dist.ProcessGroup:
            return dist.ProcessGroupGloo(dist.PrefixStore(name, store), ranks.index(rank),
                                         len(ranks), gloo_options())
        p2p = P2P(dist.ProcessGroupGloo(dist.PrefixStore("main", store), rank, 2,
                                        gloo_options()), former=former, staged=staged)
        try:
            results[rank] = body(rank, p2p)
        except Exception as e:  # noqa: BLE001 - re-raised by the test below
            errors.append(e)
        finally:
            p2p.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("exact", [False, True])
def test_buckets_launched_from_hooks_sum_to_the_whole_stages_bits(exact: bool,
                                                                  staged: bool) -> None:
    never = lambda: False  # noqa: E731 (a one-line callable)

    # built here: a stage's seeded initialisation uses the process's generator, which two
    # threads building at once would share
    stages = {(rank, mode): _stage(exact) for rank in (0, 1) for mode in ("whole", "early")}

    def body(rank: int, p2p: P2P) -> dict[str, object]:
        out = {}
        for epoch, (mode, cap) in enumerate((("whole", 0), ("early", 4096))):
            st = stages[(rank, mode)]
            p2p.subgroup(group_name(epoch, st.stage), [0, 1], never)
            buckets = StageBuckets(st=st, members=[0, 1], p2p=p2p, epoch=epoch, exact=exact,
                                   bucket_bytes=cap, local=st.grad_sum)
            _backward(st, 10 + rank, buckets.arm if mode == "early" else lambda: None)
            out[f"{mode}_launched_in_backward"] = buckets.next
            out[f"{mode}_buckets"] = len(buckets.buckets)
            out[mode] = buckets.finish(never)
            out[f"{mode}_own"] = st.grad_sum.clone()
        return out

    a, b = _on_two_members(body, staged)
    for side in (a, b):
        assert side["early_buckets"] > 3 and side["whole_buckets"] == 1
        # every bucket went out from the hooks, before the backward returned
        assert side["early_launched_in_backward"] == side["early_buckets"]
        assert side["whole_launched_in_backward"] == 0
        # hooks added each gradient as StageState.accumulate does: the same own sum
        assert torch.equal(side["early_own"], side["whole_own"])
    expected = a["whole_own"] + b["whole_own"]  # pipeline order: member 0 first
    for side in (a, b):
        assert torch.equal(side["whole"], expected) and torch.equal(side["early"], expected)
