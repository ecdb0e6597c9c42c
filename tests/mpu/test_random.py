import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.mpu.random import RNGStatesTracker


def test_fork_uses_its_own_stream_and_leaves_the_default_alone():
    tracker = RNGStatesTracker()
    torch.manual_seed(1)
    tracker.add("stream", 99)
    inside_1 = _forked_draw(tracker)
    default = torch.rand(4)
    inside_2 = _forked_draw(tracker)

    torch.manual_seed(99)
    assert torch.equal(inside_1, torch.rand(4))
    assert torch.equal(inside_2, torch.rand(4)), "a second fork continues the stream"
    torch.manual_seed(1)
    assert torch.equal(default, torch.rand(4)), "fork and add must not move the default"


def _forked_draw(tracker):
    with tracker.fork("stream"):
        return torch.rand(4)


def test_states_round_trip_and_errors():
    tracker = RNGStatesTracker()
    tracker.add("stream", 5)
    saved = tracker.get_states()
    first = _forked_draw(tracker)
    tracker.set_states(saved)
    assert torch.equal(_forked_draw(tracker), first)
    with pytest.raises(ValueError, match="seed 5"):
        tracker.add("other", 5)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("stream", 6)
    with pytest.raises(ValueError, match="not in the tracker"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert tracker.get_states() == {}


@pytest.mark.parametrize("tp", [4, 2])
def test_model_parallel_seed(dist_results, tp):
    for rank, out in enumerate(dist_results.get(tp, "seed")):
        torch.manual_seed(1234)
        assert torch.equal(out["default"], torch.rand(3)), "default stream: same everywhere"
        torch.manual_seed(1234 + 2718 + rank % tp)
        assert torch.equal(out["tracked"], torch.rand(3)), "tracked stream: per TP rank"


def _block(x, w):
    # Dropout on the default stream and on the tracked stream, like a transformer layer.
    h = F.dropout(torch.tanh(x @ w), 0.5, training=True)
    with mpu.get_cuda_rng_tracker().fork():
        h = F.dropout(h @ w, 0.5, training=True)
    return h.sin()


def _grads(use_checkpoint):
    mpu.model_parallel_cuda_manual_seed(7)
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    out = mpu.checkpoint(_block, x, w) if use_checkpoint else _block(x, w)
    out = _block(out, w)  # more draws after the checkpointed block
    out.sum().backward()
    return x.grad, w.grad, torch.rand(2), _forked_rand()


def _forked_rand():
    with mpu.get_cuda_rng_tracker().fork():
        return torch.rand(2)


def test_checkpoint_reproduces_dropout_bit_for_bit():
    plain = _grads(use_checkpoint=False)
    checkpointed = _grads(use_checkpoint=True)
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)
    assert (plain[0] == 0).any(), "dropout must be active for this test to mean anything"
