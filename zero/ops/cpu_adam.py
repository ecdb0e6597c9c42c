"""`CPUAdam`: DeepSpeedCPUAdam's API (deepspeed/ops/adam/cpu_adam.py) on torch's fused CPU
Adam kernel.

    optimizer = CPUAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01,
                        adamw_mode=True, bias_correction=True)

DeepSpeed compiles an AVX-512 + OpenMP loop for this. torch already ships one:
`torch._fused_adamw_` / `torch._fused_adam_` on CPU is one vectorised pass over (param, grad,
exp_avg, exp_avg_sq) per tensor, parallelised over the intra-op (OpenMP) threads, so one call
per flat fp32 buffer reads and writes each element once -- the 28 bytes/param memory floor
(benchmarks/cpu_adam.py measures it against torch.optim.AdamW and DeepSpeedCPUAdam). Tiles
are used only when a copy of the updated weights (16-bit model weights, or a device copy) is
written in the same pass: each tile is copied while it is still in cache.

`bias_correction=False` runs the same kernel with lr, eps and the decoupled weight decay
rescaled so that the bias-correction factors cancel exactly (see `_uncorrected`).
"""

import math

import torch

from zero.optim.hyperparameters import check_adam_hyperparameters

TILE_NUMEL = 1 << 20  # elements per tile when the update also writes a copy (4 MiB of fp32)


def adam_update(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps,
                weight_decay=0.0, adamw_mode=True, bias_correction=True, on_tile=None,
                tile_numel=TILE_NUMEL, grad_scale=None):
    """One Adam(W) update of same-shape CPU tensors, in place.

    `step` is a float32 scalar tensor that already counts this update (1 for the first).
    `on_tile(lo, hi, updated)` is called with each updated tile `param.view(-1)[lo:hi]` right
    after it is computed (for the 16-bit or device copy); tiles are `tile_numel` elements.
    `grad_scale` (a float32 scalar tensor, or None): the kernel steps on grad / grad_scale,
    which it writes back into `grad` (how a loss scale and the clip are applied without a
    pass of their own).
    """
    if not bias_correction:
        lr, eps, weight_decay = _uncorrected(float(step), lr, beta1, beta2, eps, weight_decay,
                                             adamw_mode)
    kernel = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    options = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                   amsgrad=False, maximize=False, grad_scale=grad_scale)
    if on_tile is None:
        kernel([param], [grad], [exp_avg], [exp_avg_sq], [], [step], **options)
        return
    flats = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    numel = flats[0].numel()
    for lo in range(0, numel, tile_numel):
        hi = min(numel, lo + tile_numel)
        p, g, m, v = (t[lo:hi] for t in flats)
        kernel([p], [g], [m], [v], [], [step], **options)
        on_tile(lo, hi, p)


def _uncorrected(step, lr, beta1, beta2, eps, weight_decay, adamw_mode):
    """(lr, eps, weight_decay) that make the bias-corrected kernel compute the uncorrected
    update p -= lr * m / (sqrt(v) + eps) (and p *= 1 - lr * wd in AdamW mode).

    The kernel computes p -= lr' / bc1 * m / (sqrt(v) / sqrt(bc2) + eps'); with
    lr' = lr * bc1 / sqrt(bc2) and eps' = eps / sqrt(bc2) that is the update above."""
    bc1, bc2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
    corrected_lr = lr * bc1 / bc2_sqrt
    if adamw_mode and weight_decay:
        weight_decay = weight_decay * lr / corrected_lr  # the kernel decays by lr' * wd'
    return corrected_lr, eps / bc2_sqrt, weight_decay


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for parameters in CPU memory, DeepSpeedCPUAdam's constructor and state.

    adamw_mode=True decouples weight decay (p -= lr*wd*p), False adds it to the gradient (L2).
    fp16/bf16 parameters are updated in fp32 (states fp32 with fp32_optimizer_states=True, the
    default) and written back rounded. amsgrad is refused, as DeepSpeed documents it.
    State per parameter: {"step": float32 scalar tensor, "exp_avg", "exp_avg_sq"}, as
    torch.optim.AdamW keeps it, so state dicts move between the two.
    """

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0, amsgrad=False, adamw_mode=True,
                 fp32_optimizer_states=True):
        if amsgrad:
            raise ValueError("CPUAdam does not support amsgrad (neither does DeepSpeedCPUAdam); "
                             "use amsgrad=False")
        check_adam_hyperparameters("CPUAdam", lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, adamw_mode=adamw_mode, amsgrad=False)
        super().__init__(model_params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    @classmethod
    def from_torch(cls, optimizer):
        """A CPUAdam with the param groups (same dicts, so LR schedules built on `optimizer`
        keep acting) and hyperparameters of a torch.optim.Adam / AdamW. Its state is not
        carried over (call this before the first step)."""
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"CPUAdam.from_torch takes torch.optim.Adam or AdamW, got "
                            f"{type(optimizer).__name__}")
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"CPUAdam cannot replace a torch {type(optimizer).__name__} "
                                     f"with {flag}=True; turn it off or do not offload")
            group["adamw_mode"] = decoupled or bool(group.get("decoupled_weight_decay"))
            group.setdefault("bias_correction", True)
        converted = cls.__new__(cls)
        torch.optim.Optimizer.__init__(converted, optimizer.param_groups,
                                       dict(optimizer.defaults, adamw_mode=decoupled,
                                            bias_correction=True))
        converted.fp32_optimizer_states = True
        return converted

    def load_state_dict(self, state_dict):
        """torch's load replaces the group dicts by the saved ones; a state saved by torch's
        Adam/AdamW (a run without offload) lacks CPUAdam's own flags, which then keep this
        optimizer's values."""
        saved = state_dict["param_groups"]
        if len(saved) == len(self.param_groups):  # else torch's load says what differs
            saved = [{**{flag: current[flag] for flag in ("adamw_mode", "bias_correction")},
                      **group} for group, current in zip(saved, self.param_groups)]
        super().load_state_dict({**state_dict, "param_groups": saved})

    def state_for(self, param):
        """The (lazily created) state of `param`: step and fp32 (or param-dtype) moments."""
        state = self.state[param]
        if not state:
            dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros(param.shape, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros(param.shape, dtype=dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.device.type != "cpu":
                    raise RuntimeError(
                        f"CPUAdam param is on {param.device} and must be 'cpu', make sure you "
                        "enabled 'offload_optimizer': 'cpu' in your ZeRO config.")
                state = self.state_for(param)
                state["step"] += 1
                self.update(param, param.grad, state, group)
        return loss

    @staticmethod
    def update(param, grad, state, group, on_tile=None, grad_scale=None):
        """Step `param` with `grad` (/ `grad_scale`, a scalar tensor, if given) under
        `group`'s hyperparameters (state["step"] counted)."""
        beta1, beta2 = group["betas"]
        options = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                       bias_correction=group["bias_correction"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if param.dtype == exp_avg.dtype == grad.dtype:
            adam_update(param, grad, exp_avg, exp_avg_sq, state["step"], on_tile=on_tile,
                        grad_scale=grad_scale, **options)
            return
        # 16-bit params (or grads) with fp32 states: update fp32 tiles, write them back rounded
        flat_param = param.view(-1)

        def write_back(lo, hi, updated):
            flat_param[lo:hi].copy_(updated)
            if on_tile is not None:
                on_tile(lo, hi, flat_param[lo:hi])
        for lo in range(0, param.numel(), TILE_NUMEL):
            hi = min(param.numel(), lo + TILE_NUMEL)
            p32 = flat_param[lo:hi].to(exp_avg.dtype)
            g32 = grad.reshape(-1)[lo:hi].to(exp_avg.dtype)
            adam_update(p32, g32, exp_avg.view(-1)[lo:hi], exp_avg_sq.view(-1)[lo:hi],
                        state["step"], grad_scale=grad_scale, **options)
            write_back(lo, hi, p32)


DeepSpeedCPUAdam = CPUAdam  # DeepSpeed's name, for scripts that construct it directly
