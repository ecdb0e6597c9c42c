"""Optimizers from the `optimizer` section of a DeepSpeed config (what DeepSpeed's
engine._configure_basic_optimizer builds).

    "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "weight_decay": 0.01}}

- "Adam" and "AdamW" (any case) follow DeepSpeed's FusedAdam: defaults lr 1e-3, betas
  (0.9, 0.999), eps 1e-8, weight_decay 0; `adam_w_mode` (default true) picks decoupled weight
  decay (torch.optim.AdamW) over L2 (torch.optim.Adam); "AdamW" is always decoupled. With
  `torch_adam: true` DeepSpeed builds the torch class with torch's defaults (AdamW's
  weight_decay is then 0.01), and so do we.
- "Adam8bit" / "AdamW8bit" and "Adam4bit" / "AdamW4bit" (any case) are
  zero.optim.quantized_adam's Adam8bit and Adam4bit: AdamW with 8-bit (4-bit) block-wise
  moments (params lr, betas, eps, weight_decay, min_8bit_numel / min_4bit_numel), ZeRO
  stages 0-3, offload_optimizer "cpu" (the state stays in host memory) and "nvme" (only the
  fp32 masters swap).
- "SGD" and "Adagrad" (any case) are the torch classes.
- Any other name is looked up in torch.optim, case-sensitively, as DeepSpeed does ("RMSprop").
- DeepSpeed's kernel-only optimizers (Lamb, OneBitAdam, ...) are a ConfigError.

Every problem is a ConfigError, found when the config is parsed: the section is tried on a
one-element dummy parameter, so torch's own value checks (negative lr, betas >= 1) run then.
"""

import difflib
import inspect
import logging
import math

import torch

from zero.config.parsing import AUTO, fail, say_auto_default, show
from zero.errors import ConfigError
from zero.ops.cpu_adam import CPUAdam
from zero.optim.quantized_adam import QUANTIZED_ADAMS, Adam4bit, Adam8bit

logger = logging.getLogger("zero.optim.optimizers")

FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                       "amsgrad": False}
FUSED_ADAM_DEFAULTS_QUANTIZED = {k: v for k, v in FUSED_ADAM_DEFAULTS.items()
                                 if k != "amsgrad"}
NAMED_TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}
NEEDS_DEEPSPEED_KERNELS = ("lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "muadam",
                           "muadamw", "musgd", "muon")
SUPPORTED_NAMES = "Adam, AdamW, Adam8bit (AdamW8bit), Adam4bit (AdamW4bit), Adagrad, or SGD " \
                  "or another torch.optim class by its exact name (e.g. RMSprop; under ZeRO " \
                  "these need \"zero_allow_untested_optimizer\": true, as in DeepSpeed)"

# Optimizers ZeRO is tested with (DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS, torch subset, and
# CPUAdam).
ZERO_SUPPORTED_OPTIMIZERS = [torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, CPUAdam,
                             Adam8bit, Adam4bit]


def build_optimizer(config, model_parameters):
    """The torch optimizer `config.optimizer` describes, over `model_parameters`
    (an iterable of tensors or of param-group dicts)."""
    if config.optimizer is None:
        raise _no_section_error(config.source)
    optimizer_class, kwargs = plan_optimizer(config.optimizer, config.source)
    return _construct(optimizer_class, list(model_parameters), kwargs, config.source)


def check_optimizer_section(section, source):
    """Validates type, parameter names and values without a model (called by DeepSpeedConfig)."""
    optimizer_class, kwargs = plan_optimizer(section, source)
    dummy = [torch.zeros(1, requires_grad=True)]
    _construct(optimizer_class, dummy, kwargs, source)


def check_zero_supported(optimizer, config):
    """DeepSpeed's rule: under ZeRO an untested optimizer needs zero_allow_untested_optimizer."""
    if config.zero_optimization.stage == 0 \
            or isinstance(optimizer, tuple(ZERO_SUPPORTED_OPTIMIZERS)):
        return
    name = type(optimizer).__name__
    if config.zero_allow_untested_optimizer:
        logger.warning("using the untested ZeRO optimizer %s (zero_allow_untested_optimizer)",
                       name)
        return
    tested = ", ".join(c.__name__ for c in ZERO_SUPPORTED_OPTIMIZERS)
    fail(config.source, f"{name} is not one of the optimizers ZeRO is tested with ({tested}); "
                        "add \"zero_allow_untested_optimizer\": true to the config to use it")


def plan_optimizer(section, source):
    """(torch optimizer class, constructor kwargs) for an `optimizer` section."""
    name = section.type
    params = {k: v for k, v in section.params.items() if not (isinstance(v, str) and v == AUTO)}
    for key in section.params.keys() - params.keys():
        say_auto_default(source, f"optimizer.params.{key}", f"{name}'s default")
    if "max_grad_norm" in params:
        fail(source, "'max_grad_norm' is not supported as an optimizer parameter, please switch "
                     "to using the deepspeed parameter 'gradient_clipping' (a top-level key)")
    lower = name.lower()
    if lower in ("adam", "adamw"):
        return _plan_adam(lower, params, source)
    if lower in QUANTIZED_ADAMS:
        _check_adam_values(params, source)
        optimizer_class = QUANTIZED_ADAMS[lower]
        _check_param_names(optimizer_class, params, (), source)
        return optimizer_class, {**FUSED_ADAM_DEFAULTS_QUANTIZED, **params}
    if lower in NEEDS_DEEPSPEED_KERNELS:
        needs = "1-bit compressed communication" if lower.startswith(("onebit", "zeroone")) \
            else "fused kernels"
        fail(source, f"optimizer type \"{name}\" needs DeepSpeed's {needs}, which zero does "
                     f"not ship; use one of: {SUPPORTED_NAMES}")
    optimizer_class = NAMED_TORCH_OPTIMIZERS.get(lower) or _torch_optimizer(name)
    if optimizer_class is None:
        fail(source, _unknown_type_message(name))
    _check_param_names(optimizer_class, params, (), source)
    return optimizer_class, params


def _plan_adam(lower, params, source):
    adam_w_mode = _pop_bool(params, "adam_w_mode", True, source)
    torch_adam = _pop_bool(params, "torch_adam", False, source)
    if lower == "adamw" and not adam_w_mode:
        fail(source, "optimizer type \"AdamW\" always decouples weight decay, so "
                     "'optimizer.params.adam_w_mode': false contradicts it; use type \"Adam\" "
                     "with adam_w_mode false for L2-style weight decay")
    optimizer_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    _check_adam_values(params, source)
    if torch_adam:
        _check_param_names(optimizer_class, params, (), source)
        return optimizer_class, params
    # FusedAdam's extra arguments: only their defaults have a torch equivalent
    if not _pop_bool(params, "bias_correction", True, source):
        fail(source, "'optimizer.params.bias_correction': false is not implemented by zero's "
                     "Adam; remove it")
    _pop_bool(params, "set_grad_none", True, source)  # zero_grad always sets grads to None
    _check_param_names(None, params, tuple(FUSED_ADAM_DEFAULTS), source)
    return optimizer_class, {**FUSED_ADAM_DEFAULTS, **params}


def _check_adam_values(params, source):
    """lr >= 0, two betas in [0, 1), eps > 0 and weight_decay >= 0, each named when wrong
    (torch's own checks name none, and take a third beta or a string lr to the first step);
    betas become a tuple."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
    for key, ok, what in (("lr", lambda v: number(v) and v >= 0, "a number >= 0"),
                          ("eps", lambda v: number(v) and v > 0, "a number > 0"),
                          ("weight_decay", lambda v: number(v) and v >= 0, "a number >= 0")):
        if key in params and not ok(params[key]):
            fail(source, f"'optimizer.params.{key}' must be {what}, got {show(params[key])}")
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(number(b) and 0 <= b < 1 for b in betas)):
            fail(source, "'optimizer.params.betas' must be two numbers in [0, 1), e.g. [0.9, "
                         f"0.999], got {show(betas)}")
        params["betas"] = tuple(betas)


def _pop_bool(params, key, default, source):
    value = params.pop(key, default)
    if not isinstance(value, bool):
        fail(source, f"'optimizer.params.{key}' must be true or false, got {show(value)}")
    return value


def _torch_optimizer(name):
    candidate = getattr(torch.optim, name, None)
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer) \
            and candidate is not torch.optim.Optimizer:
        return candidate
    return None


def _torch_optimizer_names():
    return [n for n in dir(torch.optim) if _torch_optimizer(n) is not None]


# DeepSpeed class names users write as a config type -> the type that builds them
_CLASS_NAMES = {"fusedadam": "Adam", "cpuadam": "Adam", "deepspeedcpuadam": "Adam"}


def _unknown_type_message(name):
    if name.lower() in _CLASS_NAMES:
        return (f"unknown optimizer type \"{name}\" (a DeepSpeed class, not a config type); "
                f"did you mean \"{_CLASS_NAMES[name.lower()]}\"? (what DeepSpeed builds as "
                "FusedAdam, and as its CPU Adam under zero_optimization.offload_optimizer) "
                f"Supported: {SUPPORTED_NAMES}")
    candidates = ["Adam", "AdamW", "SGD", "Adagrad"] + _torch_optimizer_names()
    close = [c for c in candidates if c.lower() == name.lower()]  # torch names are exact-case
    close = close or difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    hint = f"; did you mean \"{close[0]}\"?" if close else ""
    return f"unknown optimizer type \"{name}\"{hint} Supported: {SUPPORTED_NAMES}"


def _check_param_names(optimizer_class, params, allowed, source):
    if optimizer_class is not None:
        signature = inspect.signature(optimizer_class.__init__)
        if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            return
        allowed = [n for n in signature.parameters if n not in ("self", "params")]
    for key in params:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(allowed)}"
            fail(source, f"unknown optimizer parameter 'optimizer.params.{key}'; {hint}")


def _construct(optimizer_class, parameters, kwargs, source):
    try:
        return optimizer_class(parameters, **kwargs)
    except Exception as e:  # noqa: BLE001 -- any failure here comes from the user's JSON values
        name = optimizer_class.__name__
        if optimizer_class.__module__.startswith("torch.optim"):
            name = f"torch.optim.{name}"
        fail(source, f"'optimizer.params' {show(kwargs)} rejected by {name}: {e}")


def _no_section_error(source):
    return ConfigError(f"DeepSpeed config {source}: there is no 'optimizer' section and no "
                       "optimizer was passed to initialize(); add \"optimizer\": {\"type\": "
                       "\"AdamW\", \"params\": {...}} or pass optimizer=")
