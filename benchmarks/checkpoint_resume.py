"""Resume time of a ZeRO checkpoint at its own stage and at the other family of stages.

One process, a stack of Linear layers (bf16 weights, fp32 masters and AdamW moments): the
engine trains a step at the saving stage and saves; each loader then builds a fresh engine at
its stage and times `load_checkpoint` alone. The peer is plain PyTorch's resume of the same
model and AdamW state (`torch.load` of one file, `load_state_dict` into model and optimizer).
Stage 3 loads (and stage 3 checkpoints) go one parameter at a time
(zero/checkpoint/whole_params.py); stage 0-2 loads of stage 0-2 checkpoints copy whole saved
slices.

    .venv/bin/python benchmarks/checkpoint_resume.py [--width 2048 --layers 8] [--update-docs]
"""

import argparse
import os
import shutil
import tempfile
import time

import torch

import common  # noqa: F401  (puts the repository on sys.path)
from common import machine_description, markdown_table, update_docs_section

import zero

SECTION = "checkpoint_resume"


def _model(width, layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _config(stage):
    return {"train_batch_size": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _engine(stage, width, layers):
    config = _config(stage)
    if stage == 3:
        with zero.Init(config=config):
            model = _model(width, layers)
    else:
        model = _model(width, layers)
    engine, *_ = zero.initialize(model=model, config=config,
                                 model_parameters=model.parameters())
    return engine


def _train_step(engine, width):
    x = torch.randn(4, width, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _time_load(stage, directory, width, layers, repeats):
    times = []
    for _ in range(repeats):
        engine = _engine(stage, width, layers)
        start = time.perf_counter()
        engine.load_checkpoint(directory)
        times.append(time.perf_counter() - start)
        engine.destroy()
    return min(times)


def _time_plain_torch(directory, width, layers, repeats):
    model = _model(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).pow(2).mean().backward()
    optimizer.step()
    path = os.path.join(directory, "plain.pt")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    times = []
    for _ in range(repeats):
        fresh = _model(width, layers)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        start = time.perf_counter()
        state = torch.load(path, weights_only=True)
        fresh.load_state_dict(state["model"])
        fresh_optimizer.load_state_dict(state["optimizer"])
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    root = tempfile.mkdtemp()
    try:
        plain = _time_plain_torch(root, args.width, args.layers, args.repeats)
        rows = []
        for saved, loaded in ((2, 2), (2, 3), (3, 3), (3, 2)):
            directory = os.path.join(root, f"stage{saved}")
            if not os.path.isdir(directory):
                engine = _engine(saved, args.width, args.layers)
                _train_step(engine, args.width)
                engine.save_checkpoint(directory)
                engine.destroy()
            seconds = _time_load(loaded, directory, args.width, args.layers, args.repeats)
            how = "whole saved slices" if 3 not in (saved, loaded) else \
                "one parameter at a time"
            rows.append([f"stage {saved}", f"stage {loaded}", how, f"{seconds:.2f}",
                         f"{seconds / plain:.2f}x"])
    finally:
        shutil.rmtree(root)
    body = ("## Resuming a ZeRO checkpoint at another stage (`benchmarks/checkpoint_resume.py`)"
            f"\n\n{machine_description()}. {args.layers} x Linear({args.width}, {args.width}): "
            f"{params / 1e6:.1f}M parameters, bf16 weights with fp32 masters and AdamW "
            f"moments, one process; best of {args.repeats} loads. Plain PyTorch (torch.load "
            f"of model and AdamW state, load_state_dict into both): {plain:.2f} s.\n\n"
            + markdown_table(["saved at", "resumed at", "how", "load_checkpoint (s)",
                              "vs plain PyTorch"], rows))
    print(body)
    if args.update_docs:
        update_docs_section(SECTION, body)


if __name__ == "__main__":
    main()
