"""The loop's late loss reads: every loss is read once, in order, with its own iteration."""

import torch

from megatron.training.loop import _LossReads


class _Guards:
    def __init__(self):
        self.seen = []

    def after_iteration(self, iteration, loss):
        self.seen.append((iteration, loss))


def test_losses_are_read_once_in_order_the_newest_kept_until_asked():
    guards = _Guards()
    reads = _LossReads(guards)
    reads.add(1, torch.tensor(2.0))
    assert reads.read(keep_newest=True) == 0  # only the newest: still on its way
    reads.observe()
    assert guards.seen == []
    reads.add(2, torch.tensor(3.0))
    assert reads.read(keep_newest=True) == 2.0  # iteration 1's, a step late
    reads.add(3, torch.tensor(float("nan")))
    total = reads.read(keep_newest=False)  # a log line: everything up to now
    assert total != total  # the NaN reaches the window's sum
    reads.observe()
    assert [it for it, _ in guards.seen] == [1, 2, 3]
    assert guards.seen[1] == (2, 3.0)
    assert reads.read(keep_newest=False) == 0  # nothing read twice
