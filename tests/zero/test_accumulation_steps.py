"""The engine's accumulation steps as DeepSpeed's API sets them: set_train_batch_size (a
batch-size ramp's), and micro_steps written by a loop of its own."""

import numpy as np
import pytest
import torch

import zero
from tests.zero import engine_cases as cases
from tests.zero.test_engine import _batch, _config
from zero.errors import ZeroError


@pytest.mark.parametrize("stage", [0, 2])
def test_set_train_batch_size_changes_the_micro_batches_of_each_step(stage):
    """DeepSpeed's set_train_batch_size: batches of 4, 12, 8 samples (micro 4: 1, 3, 2 micro
    batches a step) give the updates of plain AdamW on each whole batch; the boundary follows
    the new count, the counters count the new batch."""
    config = _config(gradient_accumulation_steps=2, gradient_clipping=0.5,
                     zero_optimization={"stage": stage})
    engine, *_ = zero.initialize(model=cases.make_model(), config=config)
    reference = cases.make_model()
    adam = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (8, 2)
    boundaries = []
    for step, size in enumerate((4, np.int64(12), 8)):  # (numpy's ints too, as DeepSpeed)
        engine.set_train_batch_size(size)
        assert engine.gradient_accumulation_steps() == size // 4
        tokens, labels = _batch(step, size)
        for i in range(size // 4):
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(engine(tokens[4 * i:4 * i + 4], labels[4 * i:4 * i + 4]))
            engine.step()
        adam.zero_grad()
        reference(tokens, labels).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        adam.step()
        for (name, param), ref in zip(engine.module.named_parameters(),
                                      reference.parameters()):
            assert torch.allclose(param, ref, atol=1e-6), (step, name)
    assert boundaries == [True, False, False, True, False, True]
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (3, 24, 6)
    for wrong in (6, 0, -4, 4.0, True, "8"):
        with pytest.raises(ValueError, match="the global batch must be a positive multiple of "
                                             r"the micro batch x data-parallel size \(4 x 1 = "
                                             r"4\)"):
            engine.set_train_batch_size(wrong)
    engine.set_train_batch_size(torch.tensor(8))  # (an int tensor too)
    inside = "set_train_batch_size\\(\\) inside a step, after 1 of its micro batches' backward " \
             "passes: call it before a step's first forward"
    engine.backward(engine(*_batch(3)))
    engine.step()  # one micro batch of the two a step of 8 takes
    with pytest.raises(ZeroError, match=inside):
        engine.set_train_batch_size(4)
    if stage < 2:  # a backward inside no_sync (DeepSpeed's pattern), without step(): refused
        engine.backward(engine(*_batch(4)))
        engine.step()  # the step of 8 ends
        with engine.no_sync():
            engine.backward(engine(*_batch(5)))
        with pytest.raises(ZeroError, match=inside):
            engine.set_train_batch_size(4)


def test_micro_steps_written_by_a_loop_keeps_deepspeeds_boundaries():
    """A loop that sets micro_steps itself (a reset, a resume of its own): the boundaries
    are DeepSpeed's, (micro_steps + 1) % gradient_accumulation_steps == 0."""
    engine, *_ = zero.initialize(model=cases.make_model(),
                                 config=_config(gradient_accumulation_steps=4))

    def boundaries(count):
        found = []
        for _ in range(count):
            if engine.is_gradient_accumulation_boundary():
                found.append(engine.micro_steps)
            engine.backward(engine(*_batch(0)))
            engine.step()
        return found

    assert boundaries(4) == [3]
    engine.micro_steps = 0  # reset after a step
    assert boundaries(8) == [3, 7]
    engine.micro_steps += 5  # 13: inside the step that began at 12
    assert boundaries(4) == [15]
    assert engine.global_steps == 4
