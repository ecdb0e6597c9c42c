"""Activation checkpointing at run time: which recompute the model uses, and setting up
DeepSpeed's (zero.checkpointing) so its RNG tracker is the one mpu forks dropout streams from.

What --checkpoint-activations and its options mean is settled in megatron/config/activation.py.
"""

import dataclasses

from megatron import mpu
from megatron.mpu.random import use_rng_tracker


def setup_activation_checkpointing(recompute, notes, device, is_rank0):
    """Configure zero.checkpointing with `recompute` (the config's RecomputeOptions, or None
    for Megatron's recompute) and make mpu's RNG tracker its tracker, so the streams the model
    forks are the ones the recompute replays. Call before seeding."""
    notes = list(notes)
    if recompute is not None:
        from zero import checkpointing
        checkpointing.configure(mpu, **dataclasses.asdict(recompute))
        use_rng_tracker(checkpointing.get_cuda_rng_tracker())
        if device.type == "cpu":
            if recompute.checkpoint_in_cpu:
                notes.append(" note: --checkpoint-in-cpu: the model runs on the CPU, so "
                             "checkpoints already live in host memory")
            if recompute.synchronize:
                notes.append(" note: --synchronize-each-layer: CPU kernels are synchronous; "
                             "there is no device queue to wait for")
    if is_rank0:
        for note in notes:
            print(note, flush=True)


def teardown_activation_checkpointing():
    use_rng_tracker(None)
    from zero import checkpointing
    checkpointing.unconfigure()


def checkpoint_function(recompute):
    """The function ParallelTransformer recomputes chunks with."""
    if recompute is None:
        return mpu.checkpoint
    from zero import checkpointing
    return checkpointing.checkpoint
