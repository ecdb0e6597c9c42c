"""A tiny language model, its data, and training loops shared by the engine tests.

The reference loop is plain PyTorch on one process (the whole global batch at once, torch's
AdamW, torch's clip_grad_norm_), so engine results are compared against independent math.
Functions run inside `tests/dist_utils.run_distributed` workers are module-level here.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero

VOCAB, HIDDEN, SEQ = 32, 16, 8
LR = 1e-2


class TinyLM(torch.nn.Module):
    """Embedding -> LayerNorm -> residual MLP -> LayerNorm -> head tied to the embedding."""

    def __init__(self, with_frozen=False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        torch.nn.init.normal_(self.embed.weight, std=0.1)  # small logits: loss starts ~ln(V)
        self.norm1 = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN)
        self.norm2 = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter under two names
        self.register_buffer("position_bias", torch.linspace(-0.1, 0.1, HIDDEN))
        self.frozen = None
        if with_frozen:
            self.frozen = torch.nn.Linear(HIDDEN, HIDDEN)
            self.frozen.requires_grad_(False)

    def forward(self, tokens, labels):
        h = self.embed(tokens) + self.position_bias  # [b, s, h]
        if self.frozen is not None:
            h = h + 0.1 * self.frozen(h)
        h = h + self.fc2(F.gelu(self.fc1(self.norm1(h))))
        logits = self.head(self.norm2(h))  # [b, s, v]
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def make_model(seed=1234, with_frozen=False):
    torch.manual_seed(seed)
    return TinyLM(with_frozen)


def param_groups(model):
    """Megatron-style: no weight decay for biases and LayerNorm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith("bias") or "norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def global_batch(step, size):
    """(tokens, labels) [size, SEQ] of one global batch; depends on the step only."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def ds_config(stage, global_batch_size=16, gas=2, clip=1.0, precision="fp32", **zero_options):
    config = {"train_batch_size": global_batch_size, "gradient_accumulation_steps": gas,
              "gradient_clipping": clip,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, **zero_options}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def train_reference(steps, global_batch_size=16, clip=1.0, start=0, model=None, optimizer=None):
    """Plain single-process training on the full global batch; returns (losses, model, opt)."""
    model = model or make_model()
    optimizer = optimizer or torch.optim.AdamW(param_groups(model), lr=LR)
    losses = []
    for step in range(start, start + steps):
        tokens, labels = global_batch(step, global_batch_size)
        optimizer.zero_grad()
        loss = model(tokens, labels)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses, model, optimizer


def make_engine(config, model=None, mpu=None):
    model = model or make_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    return engine


def train_steps(engine, steps, start=0):
    """Global-batch losses (mean over DP ranks) of `steps` optimizer steps from `start`."""
    dp_rank, dp = engine.dp_rank, engine.dp_world_size
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for step in range(start, start + steps):
        tokens, labels = global_batch(step, engine.train_batch_size())
        mine = slice(dp_rank * micro * gas, (dp_rank + 1) * micro * gas)
        tokens, labels = tokens[mine].to(engine.device), labels[mine].to(engine.device)
        total = torch.zeros((), device=engine.device)
        for i in range(gas):
            part = slice(i * micro, (i + 1) * micro)
            loss = engine(tokens[part], labels[part])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        if dp > 1:
            dist.all_reduce(total, group=engine.dp_comm.group)
            total /= dp
        losses.append(total.item())
        assert dtype == next(engine.module.parameters()).dtype
    return losses


def fp32_weights(engine):
    """{name: fp32 weight} as the fp32 masters hold them (gathered over data parallel)."""
    from zero.checkpoint.partitions import partial_natural_partition
    optimizer = engine.optimizer
    names = {p: n for n, p in engine.module.named_parameters()}
    result = {}
    for group in optimizer.groups:
        comm = optimizer.dp_comm if group.layout.world_size > 1 else None
        natural = partial_natural_partition(group, comm)(group.master.detach())
        parts = [torch.zeros_like(natural) for _ in range(group.layout.world_size)]
        if comm is None:
            parts = [natural]
        else:
            dist.all_gather(parts, natural, group=comm.group)
        flat = torch.cat(parts)
        for param, offset, numel in zip(group.params, group.layout.offsets, group.layout.numels):
            result[names[param]] = flat[offset:offset + numel].view(param.shape).clone()
    return result


# (optimizer section or a client optimizer, the state tensor that holds the first step's
# gradient times a factor, the factor). Fused Adam takes the divisor inside its kernel,
# CPUAdam (offload) too; foreach Adam and SGD get gradients divided beforehand.
FIRST_STEP_STATES = {
    "fused AdamW": ({"type": "AdamW", "params": {"lr": 1e-3}}, "exp_avg", 0.1),
    "foreach AdamW": (lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
                      "exp_avg", 0.1),
    "SGD": ({"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}}, "momentum_buffer", 1.0),
}


def check_first_step_moment(precision, stage, offload, optimizer, clip, monkeypatch):
    """One engine step, then the optimizer state that holds the gradient it stepped on (Adam's
    first moment, SGD's momentum) must have the gradient's global norm (fp16: without the
    loss scale), or the clip when that is lower: a wrong loss scale or clip shows here, where
    Adam's losses hardly move. Fused Adam (and CPUAdam under offload) must take the divisor
    in its kernel: dividing the gradients first is refused. Returns the engine."""
    section, name, factor = FIRST_STEP_STATES[optimizer]
    if optimizer == "fused AdamW":
        from zero.offload import host_masters
        from zero.stages import masters

        def refuse(_, divisor):
            assert divisor == 1.0, "fused Adam got its gradients divided in a pass of their own"
        for module in (masters, host_masters):
            monkeypatch.setattr(module, "divide_grads", refuse)
    zero_section = {"stage": stage, "reduce_bucket_size": 300}
    if offload:
        zero_section["offload_optimizer"] = {"device": offload}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": clip,
              "zero_optimization": zero_section, "zero_allow_untested_optimizer": True}
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"initial_scale_power": 8}
                                                 if precision == "fp16" else {})}
    client = section if callable(section) else None
    if client is None:
        config["optimizer"] = section
    engine, *_ = zero.initialize(model=make_model(), config=config, optimizer=client)
    tokens, labels = global_batch(0, 4)
    engine.backward(engine(tokens.to(engine.device), labels.to(engine.device)))
    engine.step()
    assert engine.skipped_steps == 0
    norm = engine.get_global_grad_norm()
    assert norm > 2 * clip  # so the clip acts where there is one
    state = engine.optimizer.base_state_dict()["state"]
    stepped = sum(float(s[name].double().pow(2).sum()) for s in state.values()) ** 0.5
    assert stepped == pytest.approx(factor * (clip or norm), rel=1e-4)
    return engine


def two_losses_per_step(stage, steps=3, precision="fp32", no_sync_first=False):
    """Each step backpropagates two micro-batches with one engine.backward each, both at the
    accumulation boundary (gradient_accumulation_steps 1; `no_sync_first`: the first inside
    engine.no_sync()), then steps once. Returns the largest weight difference from
    single-process torch training on the sum of the two losses, averaged over the
    data-parallel ranks as the engine averages its gradients."""
    dp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = make_model()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    engine = make_engine(ds_config(stage, global_batch_size=2 * dp, gas=1, precision=precision),
                         model=model)
    reference = make_model()
    torch_adamw = torch.optim.AdamW(param_groups(reference), lr=LR)
    micro = 2
    for step in range(steps):
        tokens, labels = global_batch(step, 2 * micro * dp)  # [rank][half] micro-batches
        rows = [slice(i * micro, (i + 1) * micro) for i in range(2 * dp)]
        for half in (0, 1):
            row = rows[2 * rank + half]
            with engine.no_sync() if no_sync_first and half == 0 else contextlib.nullcontext():
                engine.backward(engine(tokens[row], labels[row]))
        engine.step()
        torch_adamw.zero_grad()
        (sum(reference(tokens[row], labels[row]) for row in rows) / dp).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch_adamw.step()
    names = dict(reference.named_parameters())
    difference = 0.0
    for name, param in engine.module.named_parameters():
        with zero.GatheredParameters(param):
            weight = param.detach().float().clone()
        difference = max(difference, (weight - names[name]).abs().max().item())
    return difference
