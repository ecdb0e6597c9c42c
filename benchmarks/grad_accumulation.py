"""Summing bf16 micro batches' gradients in fp32 or in bf16: step time and error, side by side.

One bf16 MLP (fp32 master weights, AdamW), one step of GAS micro batches of one row each (so
the gradient handling, not the matmuls, is what differs), three ways:

    plain PyTorch   autograd sums the micro batches' bf16 gradients in param.grad (bf16); the
                    step copies them into fp32 master gradients and runs torch's fused AdamW
    zero, bf16 sums ZeRO stage 0 with data_types.grad_accum_dtype "bf16" (the same sums)
    zero, fp32 sums ZeRO stage 0 with "fp32", bf16's default: each micro batch's gradients
                    are added into the fp32 masters' gradients

For each: the median milliseconds of a step (its micro batches' forward and backward and the
optimizer step), and how far the summed gradient is from the float64 sum of the same bf16
micro batch gradients (the largest difference over the largest gradient, worst parameter).

    .venv/bin/python benchmarks/grad_accumulation.py [--quick] [--write-docs]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import zero  # noqa: E402
from benchmarks.common import (  # noqa: E402
    machine_description, markdown_table, median_seconds, update_docs_section)

FULL = dict(width=1024, layers=8, accumulation=(1, 4, 16), repeats=15)
QUICK = dict(width=256, layers=4, accumulation=(1, 4), repeats=3)


def build_model(width, layers):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks).to(torch.bfloat16)


def micro_batches(width, count):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(1, width, generator=generator).to(torch.bfloat16) for _ in range(count)]


def loss_of(model, batch):
    return model(batch).float().pow(2).mean()


def exact_sum(width, layers, batches):
    """float64 sum of each micro batch's bf16 gradients of loss / len(batches)."""
    model, total = build_model(width, layers), None
    for batch in batches:
        model.zero_grad()
        (loss_of(model, batch) / len(batches)).backward()
        grads = [p.grad.double() for p in model.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return total


def worst_error(found, exact):
    return max(((f.double() - e).abs().max() / e.abs().max()).item()
               for f, e in zip(found, exact))


class PlainTorch:
    """bf16 parameters, bf16 gradient sums in param.grad, fp32 masters stepped by AdamW."""

    def __init__(self, width, layers):
        self.model = build_model(width, layers)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-4, fused=True)

    def step(self, batches, keep_sums=False):
        for batch in batches:
            (loss_of(self.model, batch) / len(batches)).backward()
        if keep_sums:
            self.summed = [p.grad.clone() for p in self.params]
        for master, param in zip(self.masters, self.params):
            master.grad = param.grad.float()
            param.grad = None
        self.optimizer.step()
        with torch.no_grad():
            for master, param in zip(self.masters, self.params):
                param.copy_(master)


class ZeroStage0:
    def __init__(self, width, layers, accumulation, dtype):
        config = {"train_micro_batch_size_per_gpu": 1,
                  "gradient_accumulation_steps": accumulation, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": dtype},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        model = build_model(width, layers)
        self.engine, *_ = zero.initialize(model=model, config=config)

    def step(self, batches, keep_sums=False):
        engine, optimizer = self.engine, self.engine.optimizer
        norm = optimizer._reduced_grad_norm_sq
        if keep_sums:  # the masters' gradients the step uses, as its norm is taken
            def capture():
                self.summed = self._masters_grads()
                return norm()
            optimizer._reduced_grad_norm_sq = capture
        for batch in batches:
            engine.backward(loss_of(engine, batch))
            engine.step()
        optimizer._reduced_grad_norm_sq = norm

    def _masters_grads(self):
        found = {}
        for group in self.engine.optimizer.groups:
            for param, offset, numel in zip(group.params, group.layout.offsets,
                                            group.layout.numels):
                grad = group.master.grad[offset:offset + numel]
                found[param] = grad.view(param.shape).clone()
        return [found[p] for p in self.engine.module.parameters()]


def measure(config):
    width, layers = config["width"], config["layers"]
    rows = []
    for accumulation in config["accumulation"]:
        batches = micro_batches(width, accumulation)
        exact = exact_sum(width, layers, batches)
        runners = {"plain PyTorch (bf16 sums)": PlainTorch(width, layers),
                   "zero, bf16 sums": ZeroStage0(width, layers, accumulation, "bf16"),
                   "zero, fp32 sums (bf16's default)": ZeroStage0(width, layers, accumulation,
                                                                  "fp32")}
        first = {}
        for name, runner in runners.items():  # the error of the first step's sums
            runner.step(batches, keep_sums=True)
            first[name] = worst_error(runner.summed, exact)
        samples = {name: [] for name in runners}
        for _ in range(config["repeats"]):  # in turns, so a slower stretch hits all three
            for name, runner in runners.items():
                samples[name].append(median_seconds(lambda r=runner: r.step(batches),
                                                    warmup=0, repeats=1))
        times = {name: statistics.median(values) for name, values in samples.items()}
        plain = times["plain PyTorch (bf16 sums)"]
        for name in runners:
            rows.append([accumulation, name, f"{times[name] * 1e3:.1f}",
                         f"{times[name] / plain:.2f}x", f"{first[name]:.1e}"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    numel = config["layers"] * (config["width"] ** 2 + config["width"])
    rows = measure(config)
    table = markdown_table(["micro batches", "gradient sums", "ms/step", "time vs plain PyTorch",
                            "error of the sum"], rows)
    body = (f"## bf16 gradient sums in fp32 or bf16 (`benchmarks/grad_accumulation.py`)\n\n"
            f"Machine: {machine_description()}.\n\n"
            f"Model: {config['layers']} bf16 Linear({config['width']}, {config['width']}) + "
            f"tanh layers, {numel / 1e6:.1f}M parameters, fp32 master weights, AdamW; micro "
            "batches of one row (the gradient handling, not the matmuls, is what differs). "
            f"Medians of {config['repeats']} steps after one warm-up, the three ways taking "
            "turns. Error: "
            "the largest difference of the summed gradient from the float64 sum of the same "
            "bf16 micro batch gradients, over the largest gradient (worst parameter).\n\n"
            + table + "\n")
    print(body)
    if args.write_docs:
        update_docs_section("grad_accumulation", body)


if __name__ == "__main__":
    main()
