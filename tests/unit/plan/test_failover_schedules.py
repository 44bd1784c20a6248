"""Failover as a transformation of schedules, checked without processes.

A step is cut at a random point of a random valid execution; one node is lost; the
survivors' remaining lists are rebuilt as the engine rebuilds them (the shadow's list
for its grown set of stages, minus what it already did; the successor's list plus
gradients sent again and activations taken again). Replaying them must finish
without deadlock, and the shadow must run every backward of the lost stage (under ZB-H1:
every input gradient and every weight gradient).
"""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bamboo.plan import schedule as S
from bamboo.plan.roles import RoleMap, plan_failover


def random_prefix(lists: list[list[S.Instruction]], steps: int, rng: random.Random):
    """Execute `steps` instructions of a random valid interleaving; positions and sent set."""
    positions = [0] * len(lists)
    sent: set = set()
    done_forward: set = set()
    done_input: set = set()
    for _ in range(steps):
        runnable = []
        for n, lst in enumerate(lists):
            if positions[n] < len(lst):
                need = S.matching_send(lst[positions[n]])
                if need is None or need in sent:
                    runnable.append(n)
        if not runnable:
            break
        n = rng.choice(runnable)
        instr = lists[n][positions[n]]
        if isinstance(instr, (S.SendActivation, S.SendGrad)):
            sent.add((type(instr), instr.stage, instr.mb))
        if isinstance(instr, S.Forward):
            done_forward.add((instr.stage, instr.mb))
        if isinstance(instr, S.BackwardInput):
            done_input.add((instr.stage, instr.mb))
        positions[n] += 1
    return positions, sent, done_forward, done_input


@given(P=st.integers(2, 6), M=st.integers(1, 6), victim=st.integers(0, 5),
       cut=st.integers(0, 400), seed=st.integers(0, 10_000),
       schedule=st.sampled_from(sorted(S.SCHEDULES)))
@settings(max_examples=400, deadline=None, derandomize=True)
def test_failover_lists_finish_without_deadlock(P: int, M: int, victim: int, cut: int,
                                                seed: int, schedule: str) -> None:
    victim %= P
    order = S.global_order(P, M, schedule)
    lists = [S.node_schedule([s], P, M, order=order) for s in range(P)]
    positions, sent, done_forward, done_input = random_prefix(lists, cut, random.Random(seed))
    done = [set(lists[n][:positions[n]]) for n in range(P)]

    plan = plan_failover(RoleMap.initial(stages=P, pipelines=1, redundancy=True), victim)
    shadow = plan.takeovers[0].new_holder
    held = plan.roles.stages_of(shadow)
    # What the lost node sent is lost, unless its receiver already took it; what was sent
    # to it is lost too.
    sent = {m for m in sent if m[1] != victim and not (m[0] is S.SendGrad and m[1] == victim + 1)}
    for n in range(P):
        if n == victim:
            continue
        for instr in done[n]:
            if isinstance(instr, (S.RecvActivation, S.RecvGrad)):
                sent.add(S.matching_send(instr))
    done_forward = {f for f in done_forward if f[0] != victim}
    done_input = {f for f in done_input if f[0] != victim}

    new_lists = []
    for n in range(P):
        if n == victim:
            continue
        stages = held if n == shadow else [n]
        remaining = [i for i in S.node_schedule(stages, P, M, order=order) if i not in done[n]]
        successor = (victim + 1) if victim + 1 < P else None
        if n == successor and n != shadow:
            resend = [S.SendGrad(n, i.mb) for i in done[n] if isinstance(i, S.SendGrad)]
            retake = [S.RecvActivation(n, i.mb) for i in done[n] if isinstance(i, S.RecvActivation)]
            remaining = resend + remaining + retake
        if n == shadow and successor is not None and successor in stages:
            # This node is the successor too: its gradients already sent stay in memory.
            sent |= {(S.SendGrad, successor, i.mb) for i in done[n] if isinstance(i, S.SendGrad)}
        new_lists.append(remaining)
    order_done = S.simulate(new_lists, sent=sent, done_forward=done_forward,
                            done_input=done_input)
    kinds = (S.Backward,) if schedule == "1f1b" else (S.BackwardInput, S.BackwardWeight)
    for kind in kinds:
        redone = [i for _, i in order_done if isinstance(i, kind) and i.stage == victim]
        assert sorted(i.mb for i in redone) == list(range(M)), kind
    # What each survivor had left of its own stage runs too.
    executed = {i for _, i in order_done}
    for n, lst in enumerate(lists):
        if n != victim:
            assert set(lst[positions[n]:]) <= executed
