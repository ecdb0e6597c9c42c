"""Activation checkpointing with DeepSpeed's API; `zero.checkpointing` is this package.

`recompute.py` holds the API (configure, checkpoint, the RNG tracker), `storage.py` where the
kept inputs wait (partitioned, on the host, contiguous), `rng_tracker.py` the named RNG
streams that make a recompute draw the same dropout masks.
"""

from zero.activation_checkpointing.recompute import (  # noqa: F401
    CheckpointFunction, CheckpointingOptions, checkpoint, configure, format_profile,
    get_cuda_rng_tracker, get_options, is_configured, last_profile,
    model_parallel_cuda_manual_seed, reset, unconfigure)
from zero.activation_checkpointing.rng_tracker import (  # noqa: F401
    MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker)
