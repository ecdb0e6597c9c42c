"""The RNG states a checkpoint carries so that resuming replays the same dropout masks and
data order: Python's, numpy's, torch's (CPU and device) and mpu's tracked streams."""

import random

import numpy as np
import torch

from megatron import mpu
from megatron.checkpointing.megatron_lm import MEGATRON_DEEPSPEED
from megatron.errors import CheckpointError
from megatron.runtime import device as device_mod


def get_rng_states(device):
    np_state = np.random.get_state()
    version, py_state, gauss = random.getstate()
    return {
        "random_rng_state": {"version": version, "state": list(py_state), "gauss": gauss},
        "np_rng_state": {"algorithm": np_state[0],
                         "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                         "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                         "cached_gaussian": float(np_state[4])},
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device_mod.get_rng_state(device),
        "rng_tracker_states": mpu.get_cuda_rng_tracker().get_states(),
    }


def set_rng_states(states, device, path):
    """Restore the states a checkpoint file `path` carries (an error if saved without)."""
    if "torch_rng_state" not in states:
        why = "converted from Megatron-DeepSpeed, whose RNG states are not carried" \
            if states.get("saved_by") == MEGATRON_DEEPSPEED else "saved with --no-save-rng"
        raise CheckpointError(f"{path} has no RNG state ({why}); load it with --no-load-rng")
    py = states["random_rng_state"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = states["np_rng_state"]
    np.random.set_state((npst["algorithm"], npst["keys"].numpy().astype(np.uint32),
                         npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(states["torch_rng_state"])
    device_mod.set_rng_state(device, states.get("cuda_rng_state"))
    mpu.get_cuda_rng_tracker().set_states(states["rng_tracker_states"])
