"""Named RNG streams and activation checkpointing that replays dropout exactly.

Dropout on activations that are replicated across tensor-parallel ranks must draw the same
mask on every rank (the default generator, seeded identically), while dropout inside a
tensor-parallel region (attention probabilities of this rank's heads) must differ per rank:
it runs under `get_cuda_rng_tracker().fork()`, which swaps in a per-rank stream.

The tracker swaps the CPU generator and, where CUDA is available, the CUDA generator too, so
it works whichever device the model runs on.
"""

import contextlib

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from megatron.mpu.initialize import get_model_parallel_rank

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _get_rng_states():
    """{"cpu": state[, "cuda": state]} of the default generators."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available() and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


class RNGStatesTracker:
    """Named generator states that `fork(name)` swaps in for the duration of a block.

    States are plain tensors ({name: {"cpu": ByteTensor, "cuda": ByteTensor}}), so they
    go into checkpoints that `torch.load(weights_only=True)` can read.
    """

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        """A copy of every named state."""
        return {name: {device: state.clone() for device, state in states.items()}
                for name, states in self.states_.items()}

    def set_states(self, states):
        self.states_ = {name: {device: state.clone() for device, state in per_device.items()}
                        for name, per_device in states.items()}

    def add(self, name, seed):
        """Create stream `name` seeded with `seed`, leaving the default generators untouched."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_.add(seed)
        saved = _get_rng_states()
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)  # this process's device only
        self.states_[name] = _get_rng_states()
        _set_rng_states(saved)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block on stream `name`, then advance that stream and restore the default."""
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not in the tracker; call "
                             f"model_parallel_cuda_manual_seed (or add) first")
        saved = _get_rng_states()
        _set_rng_states(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_states()
            _set_rng_states(saved)


CudaRNGStatesTracker = RNGStatesTracker  # Megatron's name; this one is device-agnostic
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
    tensor_parallel_seed = seed + 2718 + get_model_parallel_rank()
    torch.manual_seed(seed)
    _RNG_STATE_TRACKER.reset()
    _RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_parallel_seed)


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
