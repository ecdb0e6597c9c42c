"""Named RNG streams for tensor-parallel dropout (DeepSpeed's `CudaRNGStatesTracker`).

Dropout on activations replicated across tensor-parallel ranks must draw the same mask on every
rank (the default generators, seeded identically), while dropout inside a tensor-parallel
region (attention probabilities of this rank's heads) must differ per rank: it runs under
`get_cuda_rng_tracker().fork()`, which swaps a per-rank stream into the default generators.

The tracker swaps the CPU generator and, where CUDA is in use, the current CUDA device's
generator, so it works on either device. States are plain tensors
({name: {"cpu": ByteTensor[, "cuda": ByteTensor]}}), the layout Megatron's tracker uses, so
they go into checkpoints that `torch.load(weights_only=True)` reads.
"""

import contextlib

import torch

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
TENSOR_PARALLEL_SEED_OFFSET = 2718  # Megatron's and DeepSpeed's constant


def get_rng_states():
    """{"cpu": state[, "cuda": state]} of the default generators."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class CudaRNGStatesTracker:
    """Named generator states that `fork(name)` swaps in for the duration of a block."""

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        """A copy of every named state."""
        return {name: {device: state.clone() for device, state in per_device.items()}
                for name, per_device in self.states_.items()}

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
        saved = get_rng_states()
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)  # this process's device only
        self.states_[name] = get_rng_states()
        set_rng_states(saved)

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block on stream `name`, then keep that stream's advance, restore the default."""
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not in the tracker; call "
                             f"model_parallel_cuda_manual_seed (or add) first")
        saved = get_rng_states()
        set_rng_states(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_rng_states()
            set_rng_states(saved)


RNGStatesTracker = CudaRNGStatesTracker  # the name says CUDA; it tracks the CPU generator too


def seed_model_parallel(tracker, seed, tensor_parallel_rank):
    """The default generators get `seed` (the same on every tensor-parallel rank: replicated
    dropout and weight init); the tracked stream gets seed + 2718 + tensor-parallel rank."""
    torch.manual_seed(seed)  # CPU and every CUDA device
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + TENSOR_PARALLEL_SEED_OFFSET + tensor_parallel_rank)
