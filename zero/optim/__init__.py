"""What a DeepSpeed config builds around the model: the optimizer (`optimizers.py`), the
learning-rate schedule (`lr_schedules.py`) and the fp16 loss scaler (`loss_scaler.py`). The
kernels themselves are in `zero.ops`."""
