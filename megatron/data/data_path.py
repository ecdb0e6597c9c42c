"""--data-path's values: one dataset prefix, or a blend of several (`0.3 A 0.7 B`, weighted, as
Megatron-LM 2.x and later take them; `A B`, weighted by each dataset's tokens, as
Megatron-core). No torch here: the config checks them before anything heavy is imported;
megatron/data/blend.py samples the blend.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.errors import ConfigError


@dataclass(frozen=True)
class DataBlend:
    prefixes: Tuple[str, ...]
    weights: Optional[Tuple[float, ...]]  # summing to 1; None: by each dataset's tokens


def parse_data_path(values, flag="--data-path"):
    """--data-path's values (or those of `flag`: --train-data-path, ...): PREFIX, W1 PREFIX1
    W2 PREFIX2 ..., or PREFIX1 PREFIX2 ...; one ConfigError for anything else. One value is
    a prefix whatever it reads as (`2020`); in a blend a value that reads as a number is a
    weight (write such a prefix as ./2020)."""
    values = [values] if isinstance(values, str) else list(values)
    numbers = [_number(v) for v in values]
    if not values:
        raise ConfigError(f"{flag} needs a dataset prefix")
    if len(values) == 1:
        return DataBlend(tuple(values), None)
    if numbers[0] is None:  # prefixes alone
        if any(n is not None for n in numbers):
            raise ConfigError(f"{flag} {' '.join(values)}: give a weight before every "
                              "prefix (W1 PREFIX1 W2 PREFIX2 ...) or none (a prefix that "
                              "reads as a number: ./2020)")
        _check_distinct(values, flag)
        return DataBlend(tuple(values), None)
    pairs = list(zip(values[0::2], numbers[0::2], values[1::2], numbers[1::2]))
    if len(values) % 2 or any(weight is None or prefix_number is not None
                              for _, weight, _, prefix_number in pairs):
        raise ConfigError(f"{flag} {' '.join(values)}: a weighted blend alternates "
                          "weights and prefixes, W1 PREFIX1 W2 PREFIX2 ... (a prefix that "
                          "reads as a number: ./2020)")
    weights = [weight for _, weight, _, _ in pairs]
    if any(not (math.isfinite(w) and w > 0) for w in weights):
        raise ConfigError(f"{flag} {' '.join(values)}: every weight must be a positive "
                          "number")
    prefixes = [prefix for _, _, prefix, _ in pairs]
    _check_distinct(prefixes, flag)
    total = sum(weights)
    return DataBlend(tuple(prefixes), tuple(w / total for w in weights))


def _number(value):
    try:
        return float(value)
    except ValueError:
        return None


def _check_distinct(prefixes, flag):
    repeated = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if repeated:
        raise ConfigError(f"{flag} names {', '.join(repeated)} twice: give each dataset "
                          "once, with its whole weight")
