"""Named RNG streams for tensor-parallel dropout (Megatron's and DeepSpeed's
`CudaRNGStatesTracker`); the one tracker class both mpu and zero.checkpointing use.

Dropout on activations replicated across tensor-parallel ranks must draw the same mask on every
rank (the default generators, seeded identically), while dropout inside a tensor-parallel
region (attention probabilities of this rank's heads) must differ per rank: it runs under
`tracker.fork()`, which swaps a per-rank stream into the default generators.

The tracker swaps the CPU generator and, once CUDA is initialised, the current CUDA device's
generator, so it works on either device and never initialises CUDA itself (a CPU run on a GPU
machine keeps its GPUs untouched). A stream added before CUDA is initialised gets its CUDA
state from its seed at its first fork after. States are plain tensors
({name: {"cpu": ByteTensor[, "cuda": ByteTensor]}}), the layout Megatron's tracker uses, so
they go into checkpoints that `torch.load(weights_only=True)` reads.
"""

import contextlib

import torch

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
TENSOR_PARALLEL_SEED_OFFSET = 2718  # Megatron's and DeepSpeed's constant


def _cuda_in_use():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def get_rng_states():
    """{"cpu": state[, "cuda": state]} of the default generators."""
    states = {"cpu": torch.get_rng_state()}
    if _cuda_in_use():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and _cuda_in_use():
        torch.cuda.set_rng_state(states["cuda"])


class RNGStatesTracker:
    """Named generator states that `fork(name)` swaps in for the duration of a block."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = {}  # name -> seed

    def get_states(self):
        """A copy of every named state."""
        return {name: {device: state.clone() for device, state in per_device.items()}
                for name, per_device in self.states_.items()}

    def set_states(self, states):
        self.states_ = {name: {device: state.clone() for device, state in per_device.items()}
                        for name, per_device in states.items()}

    def add(self, name, seed):
        """Create stream `name` seeded with `seed`, leaving the default generators untouched."""
        if seed in self.seeds_.values():
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_[name] = seed
        default = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)
        self.states_[name] = {"cpu": torch.get_rng_state()}
        torch.set_rng_state(default)
        self._add_cuda_state(name)

    def _add_cuda_state(self, name):
        """Stream `name`'s CUDA state, from its seed, once CUDA is in use. (Seeding CUDA before
        it is initialised would queue the seed for the default generator itself.)"""
        if "cuda" in self.states_[name] or name not in self.seeds_ or not _cuda_in_use():
            return
        default = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(self.seeds_[name])  # this process's device only
        self.states_[name]["cuda"] = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(default)

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block on stream `name`, then keep that stream's advance, restore the default."""
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not in the tracker; call "
                             f"model_parallel_cuda_manual_seed (or add) first")
        self._add_cuda_state(name)
        saved = get_rng_states()
        set_rng_states(self.states_[name])
        try:
            yield
        finally:
            after = get_rng_states()
            if "cuda" not in saved:  # CUDA started inside the block, on the default
                after.pop("cuda", None)  # generator: the stream gets its own at its next fork
            self.states_[name] = after
            set_rng_states(saved)


CudaRNGStatesTracker = RNGStatesTracker  # Megatron's name; it tracks the CPU generator too


def seed_model_parallel(tracker, seed, tensor_parallel_rank):
    """The default generators get `seed` (the same on every tensor-parallel rank: replicated
    dropout and weight init); the tracked stream gets seed + 2718 + tensor-parallel rank."""
    torch.manual_seed(seed)  # CPU and every CUDA device
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + TENSOR_PARALLEL_SEED_OFFSET + tensor_parallel_rank)
