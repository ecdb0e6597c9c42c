"""Runs inside the quantisation peers' venv (benchmarks/install_quantization_peers_venv.sh):
times one peer optimizer on one flat fp32 parameter and prints

    RESULT <median ms per step> <state bytes per parameter>

    python quantization_peers_task.py <bnb8|ao8|ao4> <numel> <repeats>

torch + the peer package only; benchmarks/quantization.py calls it through a subprocess.
"""

import statistics
import sys
import time

import torch


def make(name, params):
    if name == "bnb8":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=1e-3, weight_decay=0.01)
    from torchao.optim import AdamW4bit, AdamW8bit
    optimizer = {"ao8": AdamW8bit, "ao4": AdamW4bit}[name]
    return optimizer(params, lr=1e-3, weight_decay=0.01)


def tensor_bytes(value):
    """Bytes a state entry holds, looking inside tensor subclasses (torchao's quantised
    states keep codes and scales as inner tensors)."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return 0
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is not None and type(value) is not torch.Tensor:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(value, n)) for n in names)
    return value.numel() * value.element_size()


def main():
    name, numel, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-2
    optimizer = make(name, [param])
    for _ in range(2):  # warm-up (torchao compiles its step on the first call)
        optimizer.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    state = sum(tensor_bytes(v) for s in optimizer.state.values() for k, v in s.items()
                if not k.startswith("qmap"))  # bitsandbytes' code tables are shared, 2 KB
    print(f"RESULT {statistics.median(times) * 1000:.3f} {state / numel:.4f}", flush=True)


if __name__ == "__main__":
    main()
