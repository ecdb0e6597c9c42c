"""Where and how the processes run: launcher discovery, torch.distributed and mpu groups,
the device, activation-checkpointing setup, stopping cleanly, and fault-injection hooks for
tests."""
