"""`import zero.checkpointing` (deepspeed.checkpointing's name) gives the
zero.activation_checkpointing package itself, not a copy of its names."""

import sys

from zero import activation_checkpointing

sys.modules[__name__] = activation_checkpointing
