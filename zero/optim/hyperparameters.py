"""The checks every Adam of the engine (CPUAdam, Adam8bit, Adam4bit) runs on its constructor's
values, so a bad one is named with the value it got (torch.optim.Adam's checks do the same)."""

import math


def check_adam_hyperparameters(owner, lr, betas, eps, weight_decay):
    """ValueError naming `owner` and the first argument out of range."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (number(value) and value >= 0):
            raise ValueError(f"{owner}: invalid {name} {value!r} (must be a number >= 0)")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2
            and all(number(b) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{owner}: invalid betas {betas!r} (two numbers in [0, 1))")
