"""The trainer: `pretrain()` and its loop, the learning-rate schedule, the log line and
metrics."""
