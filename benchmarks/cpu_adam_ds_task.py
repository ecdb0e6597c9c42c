"""Runs inside the DeepSpeed venv (torch + deepspeed only): median ms of one
DeepSpeedCPUAdam step on one flat fp32 tensor. Usage: python cpu_adam_ds_task.py NUMEL THREADS"""

import statistics
import sys
import time

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

numel, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
param = torch.nn.Parameter(torch.randn(numel))
param.grad = torch.randn(numel)
optimizer = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01)
times = []
for i in range(13):
    start = time.perf_counter()
    optimizer.step()
    times.append(time.perf_counter() - start)
print(f"RESULT {statistics.median(times[3:]) * 1000:.3f}")
