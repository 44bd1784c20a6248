"""Which dataset indices each step's micro-batches take (`bamboo.data.sampling`, through
`bamboo.data.datasets.Task`): no repetition within an epoch, the same indices whichever node
asks and in whatever order, a resumed run continuing mid-epoch where the first stopped."""
from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bamboo.data.datasets import Batch, Samples, Task
from bamboo.data.sampling import dataset_indices, permutation, position_after, positions


class Numbered(Samples):
    """n samples: sample i is the tensor [i] (its index, as the batch shows it)."""

    def __init__(self, n: int) -> None:
        self.size = n

    def batch(self, indices: list[int], val: bool) -> Batch:
        x = torch.tensor(indices)
        return Batch(x, x)


def _task(n: int, seed: int, G: int, B: int) -> Task:
    return Task(samples=Numbered(n), seed=seed, global_micro_batches=G, micro_batch_size=B)


shapes = st.tuples(st.integers(1, 60), st.integers(0, 2**31), st.integers(1, 5),
                   st.integers(1, 6))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_each_epoch_takes_every_index_exactly_once(shape: tuple[int, int, int, int]) -> None:
    n, seed, G, B = shape
    task = _task(n, seed, G, B)
    steps = -(-3 * n // (G * B))  # three epochs at least
    drawn = [i for step in range(steps) for g in range(G) for i in task.sample_indices(step, g)]
    for epoch in range(3):
        assert Counter(drawn[epoch * n:(epoch + 1) * n]) == Counter(range(n)), (epoch, drawn)
    assert all(0 <= i < n for i in drawn)


@settings(max_examples=40, deadline=None)
@given(shapes, st.randoms(use_true_random=False))
def test_any_node_in_any_order_takes_the_same_indices(shape: tuple[int, int, int, int],
                                                      rng) -> None:
    """A node asking for (step, micro-batch) pairs in a shuffled order, with other epochs'
    permutations in its cache, gets what a node asking in order gets."""
    n, seed, G, B = shape
    pairs = [(step, g) for step in range(7) for g in range(G)]
    in_order = {p: _task(n, seed, G, B).sample_indices(*p) for p in pairs}
    permutation.cache_clear()
    shuffled = list(pairs)
    rng.shuffle(shuffled)
    other = _task(n, seed, G, B)
    assert {p: other.sample_indices(*p) for p in shuffled} == in_order
    assert all(other.batch(*p).inputs.tolist() == in_order[p] for p in pairs[:3])


def test_the_order_is_a_function_of_the_seed_and_the_epoch() -> None:
    a, b = permutation(3, 0, 50).tolist(), permutation(3, 1, 50).tolist()
    assert sorted(a) == sorted(b) == list(range(50)) and a != b  # reshuffled per epoch
    assert permutation(4, 0, 50).tolist() != a  # another seed, another order
    assert positions(2, 1, 3, 4) == range(28, 32)  # (step * G + g) * B
    # position p of a dataset of n: epoch p // n, index permutation[p % n]
    assert dataset_indices(3, 50, [0, 49, 50, 77]) == [a[0], a[49], b[0], b[27]]


@settings(max_examples=40, deadline=None)
@given(shapes, st.integers(1, 12))
def test_a_resumed_run_continues_mid_epoch(shape: tuple[int, int, int, int], done: int) -> None:
    """A run stopped after `done` steps and resumed (a fresh process: nothing cached) takes
    the samples the uninterrupted run takes next, and its recorded position says where in
    which epoch that is."""
    n, seed, G, B = shape
    whole = [_task(n, seed, G, B).sample_indices(step, g) for step in range(done + 4)
             for g in range(G)]
    permutation.cache_clear()
    resumed = [_task(n, seed, G, B).sample_indices(step, g) for step in range(done, done + 4)
               for g in range(G)]
    assert resumed == whole[done * G:]
    here = position_after(done, G, B, n)
    assert (here.epoch, here.position, here.samples) == (done * G * B // n, done * G * B % n,
                                                         done * G * B)
    nxt = dataset_indices(seed, n, [here.samples])[0]
    assert nxt == int(permutation(seed, here.epoch, n)[here.position]) == resumed[0][0]


def test_held_out_micro_batches_are_the_eval_set_in_order() -> None:
    samples = Numbered(10)
    samples.eval_size = 6
    task = Task(samples=samples, seed=0, global_micro_batches=2, micro_batch_size=4)
    assert [task.eval_batch(i).inputs.tolist() for i in range(3)] == \
        [[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5]]
    assert task.position_after(3).to_dict() == {"epoch": 2, "position": 4, "samples": 24,
                                                "dataset_size": 10}
