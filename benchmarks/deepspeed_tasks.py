"""Jobs that run INSIDE the DeepSpeed venv (torch + deepspeed only; never zero or megatron).

    python deepspeed_tasks.py version
    python deepspeed_tasks.py consolidate <checkpoint_dir> <out.pt> [<dir> <out.pt> ...]
        DeepSpeed's own zero_to_fp32 (get_fp32_state_dict_from_zero_checkpoint) -> torch.save;
        a checkpoint it rejects writes <out.pt>.error with the message instead
    RANK=.. WORLD_SIZE=.. python deepspeed_tasks.py train_tiny <out_dir> <stage> [steps]
        real DeepSpeed trains TinyNet (fp32, gloo) and saves a checkpoint to <out_dir>/ckpt;
        rank 0 writes the live fp32 weights to <out_dir>/live.pt, and each parameter's fp32
        master and Adam moments, as DeepSpeed's optimizer holds them, to live_optimizer.pt

Started through benchmarks/deepspeed_venv.py, which sets DS_ACCELERATOR=cpu.
"""

import os
import sys

import torch
import torch.nn.functional as F

VOCAB, HIDDEN = 64, 32


class TinyNet(torch.nn.Module):
    """Embedding -> MLP -> LayerNorm -> head tied to the embedding (shared_params case)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.fc2 = torch.nn.Linear(3 * HIDDEN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, tokens):  # [b, s]
        h = self.embed(tokens) * self.scale[0]
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(self.norm(h))  # [b, s, v]
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def consolidate(*pairs):
    for checkpoint_dir, out_path in zip(pairs[::2], pairs[1::2]):
        try:
            _consolidate_one(checkpoint_dir, out_path)
        except Exception as e:  # noqa: BLE001 -- recorded for the caller to report
            with open(out_path + ".error", "w") as f:
                f.write(f"{type(e).__name__}: {e}")


def _consolidate_one(checkpoint_dir, out_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)
    # lazy tensors (newer DeepSpeed) and shared aliases: plain contiguous copies, aliases kept
    plain, seen = {}, {}
    for name, tensor in state.items():
        tensor = tensor.contiguous() if hasattr(tensor, "contiguous") else tensor
        key = id(state[name])
        plain[name] = seen.setdefault(key, tensor.detach().clone())
    torch.save(plain, out_path)


def train_tiny(out_dir, stage, steps=3):
    import deepspeed
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(7)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": int(stage)}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    for step in range(int(steps)):
        generator = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, VOCAB, (2, 9), generator=generator)
        engine.backward(engine(tokens))
        engine.step()
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"))
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=int(stage) == 3):
        live = {name: p.detach().float().clone() for name, p in params}
    # the optimizer's own view of each parameter (collectives: every rank asks)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    optimizer_state = {name: {"master": safe_get_full_fp32_param(p).clone(),
                              **{key: safe_get_full_optimizer_state(p, key).clone()
                                 for key in ("exp_avg", "exp_avg_sq")}}
                       for name, p in params}
    if rank == 0:
        torch.save(live, os.path.join(out_dir, "live.pt"))
        torch.save(optimizer_state, os.path.join(out_dir, "live_optimizer.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv):
    command, args = argv[0], argv[1:]
    if command == "version":
        import deepspeed
        print(deepspeed.__version__)
    elif command == "consolidate":
        consolidate(*args)
    elif command == "train_tiny":
        train_tiny(*args)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
