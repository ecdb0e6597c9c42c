"""The process-wide RNG tracker and activation checkpointing that replays dropout exactly.

Dropout on activations that are replicated across tensor-parallel ranks must draw the same
mask on every rank (the default generator, seeded identically), while dropout inside a
tensor-parallel region (attention probabilities of this rank's heads) must differ per rank:
it runs under `get_cuda_rng_tracker().fork()`, which swaps in a per-rank stream. The tracker
class is zero.checkpointing's (zero/activation_checkpointing/rng_tracker.py): CPU and CUDA
generators, the same state layout in checkpoints.
"""

import contextlib

from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from megatron.mpu.initialize import get_model_parallel_rank
from zero.activation_checkpointing.rng_tracker import (  # noqa: F401 (mpu's names)
    CudaRNGStatesTracker, RNGStatesTracker, seed_model_parallel)

_DEFAULT_TRACKER = RNGStatesTracker()
_RNG_STATE_TRACKER = _DEFAULT_TRACKER


def get_cuda_rng_tracker():
    """The process-wide tracker (Megatron's name; it tracks CPU and CUDA generators)."""
    return _RNG_STATE_TRACKER


def use_rng_tracker(tracker):
    """Make `tracker` (same API, e.g. zero.checkpointing's) the one the model forks and the
    checkpoints save, as Megatron-DeepSpeed does under --deepspeed-activation-checkpointing:
    its recompute replays its own tracker. None restores this module's own."""
    global _RNG_STATE_TRACKER
    _RNG_STATE_TRACKER = _DEFAULT_TRACKER if tracker is None else tracker


def model_parallel_cuda_manual_seed(seed):
    """Seed the default generators with `seed` (same on every rank: replicated dropout and
    weight init) and the tracked "model-parallel-rng" stream with seed + 2718 + tp_rank.
    """
    seed_model_parallel(_RNG_STATE_TRACKER, seed, get_model_parallel_rank())


def _tracker_replay_contexts():
    """(forward, recompute) contexts: recompute starts from the tracker states of forward.

    torch.utils.checkpoint already replays the CPU and device generators; this adds the
    tracker's named streams, so dropout under `fork()` draws the same masks on recompute.
    """
    tracker = get_cuda_rng_tracker()
    saved = {}

    @contextlib.contextmanager
    def forward_context():
        saved["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute_context():
        after_forward = tracker.get_states()
        tracker.set_states(saved["states"])
        try:
            yield
        finally:
            tracker.set_states(after_forward)

    return forward_context(), recompute_context()


def checkpoint(function, *args):
    """Run function(*args) without keeping its activations; recompute them in backward.

    The recompute sees the same CPU, device and tracker RNG states as the forward did, so
    dropout masks, and therefore gradients, are identical to a run without checkpointing.
    """
    return _torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                             context_fn=_tracker_replay_contexts)
