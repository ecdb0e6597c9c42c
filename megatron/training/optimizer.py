"""AdamW with Megatron's parameter groups, gradient clipping and 16-bit master weights.

One wrapper serves every precision. Each model parameter gets an fp32 "master" that the inner
`torch.optim.AdamW` updates: for an fp32 parameter the master is the parameter itself (so an
fp32 run is plain AdamW over the model), for an fp16/bf16 parameter it is an fp32 copy.

`step()` does, in order:
  1. master.grad = model grad cast to fp32 (16-bit params; the 16-bit grad is then freed);
  2. with a loss scaler: unscale all master grads and check them for inf/nan in one fused op;
  3. grad_norm_fn(masters_with_grads, clip_grad or inf): total norm (tensor-parallel aware in
     the trainer), clipping when clip_grad > 0. A non-finite norm marks an overflow. Going
     through the all-reduced norm keeps the skip decision identical on all model-parallel
     ranks, so the check runs even when clipping is off;
  4. loss_scaler.update(found_inf);
  5. on overflow: drop the master grads and return (False, None, None), parameters untouched;
  6. otherwise AdamW on the masters, then copy them into the 16-bit model parameters.

`grad_norm_fn(params, max_norm)` must return the pre-clipping total 2-norm as a float and must
treat max_norm=inf as "measure only" (Megatron's `clip_coef = max_norm / (norm + 1e-6)` rule
does), and must be called on every rank (it may run collectives).
"""

import math

import torch

from megatron.errors import CheckpointError, ConfigError
from megatron.loss_scaler import DynamicLossScaler

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def get_param_groups(model, weight_decay=0.01):
    """[decay group, no-decay group]: biases and LayerNorm parameters get no weight decay.

    A LayerNorm is any torch.nn.LayerNorm or a module whose class name ends in "LayerNorm"
    (custom or fused implementations). Empty groups are dropped; shared parameters counted once.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        is_layernorm = isinstance(module, torch.nn.LayerNorm) or \
            type(module).__name__.endswith("LayerNorm")
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if is_layernorm or name.endswith("bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def clip_grad_norm_fp32(params, max_norm):
    """Single-process gradient clipping: returns the total 2-norm of the grads before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:  # False for inf max_norm and for a nan/inf norm
        torch._foreach_mul_(grads, clip_coef)
    return total_norm


def build_optimizer(model, lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad,
                    params_dtype, loss_scaler=None, grad_norm_fn=None):
    if params_dtype not in (torch.float32,) + _SIXTEEN_BIT:
        raise ValueError(f"params_dtype must be float32, float16 or bfloat16, got {params_dtype}")
    if clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0 (0 disables clipping), got {clip_grad}")
    if params_dtype == torch.float16 and loss_scaler is None:
        loss_scaler = DynamicLossScaler()  # fp16 gradients underflow without scaling
    groups = get_param_groups(model, weight_decay)
    return MegatronOptimizer(groups, lr=lr, betas=(adam_beta1, adam_beta2), eps=adam_eps,
                             clip_grad=clip_grad, loss_scaler=loss_scaler,
                             grad_norm_fn=grad_norm_fn or clip_grad_norm_fp32)


class MegatronOptimizer:
    def __init__(self, param_groups, lr, betas, eps, clip_grad, loss_scaler, grad_norm_fn):
        self.clip_grad = clip_grad
        self.loss_scaler = loss_scaler
        self.grad_norm_fn = grad_norm_fn
        # Per group, parallel lists: model params and their fp32 masters (the same tensor for
        # fp32 params).
        self.model_groups = [list(group["params"]) for group in param_groups]
        self.master_groups = [[_make_master(p) for p in params] for params in self.model_groups]
        inner_groups = [dict(group, params=masters)
                        for group, masters in zip(param_groups, self.master_groups)]
        device = self.model_groups[0][0].device if self.model_groups else torch.device("cpu")
        self.optimizer = torch.optim.AdamW(inner_groups, lr=lr, betas=betas, eps=eps,
                                           **_adamw_impl(device))
        self._impl_flags = {k: self.optimizer.param_groups[0][k] for k in _IMPL_FLAGS
                            if self.optimizer.param_groups and k in self.optimizer.param_groups[0]}
        # (model, master) pairs that need grads copied in and weights copied out.
        self._copies = [(p, m) for ps, ms in zip(self.model_groups, self.master_groups)
                        for p, m in zip(ps, ms) if m is not p]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self):
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss):
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def zero_grad(self, set_to_none=True):
        for params in self.model_groups:
            for param in params:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()
        self._release_master_grads()

    @torch.no_grad()
    def step(self):
        """Returns (update_successful, grad_norm or None when skipped, num_zeros=None)."""
        self._copy_model_grads_to_masters()
        masters_with_grads = [m for ms in self.master_groups for m in ms if m.grad is not None]
        found_inf_local = self._unscale(masters_with_grads)
        max_norm = self.clip_grad if self.clip_grad > 0 else math.inf
        grad_norm = float(self.grad_norm_fn(masters_with_grads, max_norm))
        found_inf = not math.isfinite(grad_norm) or found_inf_local
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        if found_inf:
            self._release_master_grads()
            return False, None, None
        self.optimizer.step()
        self._release_master_grads()
        self._copy_masters_to_model()
        return True, grad_norm, None

    def _copy_model_grads_to_masters(self):
        for param, master in self._copies:
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None  # the fp32 copy replaces it; frees 2 bytes/param for the step

    def _unscale(self, grads_params):
        """Divide grads by the loss scale; True if any local grad is inf/nan (fp16 only)."""
        if self.loss_scaler is None or not grads_params:
            return False
        found_inf = False
        for device, grads in _grads_by_device(grads_params).items():
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = torch.full((1,), 1.0 / self.loss_scaler.scale, dtype=torch.float32,
                                   device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale)
            found_inf = found_inf or bool(flag.item())
        return found_inf

    def _release_master_grads(self):
        for param, master in self._copies:
            master.grad = None

    def _copy_masters_to_model(self):
        if self._copies:
            torch._foreach_copy_([p.data for p, _ in self._copies],
                                 [m.data for _, m in self._copies])

    def state_dict(self):
        """Plain containers and tensors only (loads with torch.load(weights_only=True))."""
        masters = [[m if m is not p else None for p, m in zip(ps, ms)]
                   for ps, ms in zip(self.model_groups, self.master_groups)]
        return {"optimizer": self.optimizer.state_dict(),
                "fp32_from_fp16_params": masters,
                "grad_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        if "optimizer" not in state_dict:
            raise CheckpointError("optimizer state has no 'optimizer' entry: it was not saved "
                                  "by this trainer. Load with --no-load-optim")
        inner_state = dict(state_dict["optimizer"])
        # Keep this machine's AdamW implementation (fused on CPU/CUDA) whatever saved it.
        inner_state["param_groups"] = [dict(g, **self._impl_flags)
                                       for g in inner_state["param_groups"]]
        try:
            self.optimizer.load_state_dict(inner_state)
        except ValueError as error:
            raise CheckpointError(f"the optimizer state does not fit this model's parameters "
                                  f"({error}). Load with --no-load-optim, or use the flags "
                                  "the checkpoint was trained with") from error
        self._load_masters(state_dict.get("fp32_from_fp16_params"))
        scaler_state = state_dict.get("grad_scaler")
        if self.loss_scaler is not None and scaler_state is not None:
            self.loss_scaler.load_state_dict(scaler_state)

    def _load_masters(self, saved_groups):
        """Take the saved fp32 masters where both runs have them.

        A run resumed in another precision still loads: a 16-bit parameter without a saved
        master keeps the master made from the loaded weights; an fp32 parameter with a saved
        master takes it (it is more exact than the 16-bit weights in the model file).
        """
        if saved_groups is None:
            return
        if [len(g) for g in saved_groups] != [len(g) for g in self.master_groups]:
            raise CheckpointError("the checkpoint's fp32 master weights are grouped differently "
                                  "from this model's parameters; load with --no-load-optim")
        for saved, params, masters in zip(saved_groups, self.model_groups, self.master_groups):
            for saved_master, param, master in zip(saved, params, masters):
                if saved_master is None:
                    if master is not param:
                        master.copy_(param)
                    continue
                if saved_master.shape != master.shape:
                    raise CheckpointError(
                        f"fp32 master weight of shape {tuple(saved_master.shape)} does not fit "
                        f"parameter of shape {tuple(master.shape)}; load with --no-load-optim")
                master.copy_(saved_master)
        self._copy_masters_to_model()


def _make_master(param):
    if param.dtype not in _SIXTEEN_BIT:
        return param
    master = param.detach().clone().float()
    # Carry tensor-parallel markers (e.g. tensor_model_parallel, partition_dim) so a
    # tensor-parallel grad_norm_fn treats the master like the model parameter.
    for key, value in vars(param).items():
        setattr(master, key, value)
    return master


def _adamw_impl(device):
    # The fused kernels exist on CPU and CUDA; on CPU fused is ~6x faster than foreach here.
    if device.type in ("cpu", "cuda"):
        return {"fused": True}
    return {"foreach": True}


def _grads_by_device(params):
    by_device = {}
    for param in params:
        by_device.setdefault(param.grad.device, []).append(param.grad)
    return by_device
