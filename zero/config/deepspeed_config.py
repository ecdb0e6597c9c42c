"""`DeepSpeedConfig`: a DeepSpeed JSON config as typed attributes, validated strictly.

    config = DeepSpeedConfig("ds_config.json", dp_world_size=2)
    config.train_micro_batch_size_per_gpu, config.zero_optimization.stage, config.fp16.enabled

The config may be a dict, a path to a JSON file (duplicate keys are an error), or a URL-safe
base64-encoded JSON string, as `deepspeed.initialize` accepts (HJSON files are not). Attribute
names are DeepSpeed's key names; the sections are the dataclasses of `sections.py`.

Differences from DeepSpeed, on purpose: an unknown or misspelled key is an error at every
level, top level included (DeepSpeed ignores unknown top-level keys, issue #1809), naming the
key, its section and the closest valid key; DeepSpeed features zero does not implement are
accepted only at their defaults; every error is a `ConfigError` whose message shows the
arithmetic or the offending value instead of an `AssertionError`.
"""

import base64
import binascii
import copy
import dataclasses
import json
import os

from zero.config.parsing import collect_key_homes, fail, parse_section
from zero.config.sections import TopLevelConfig
from zero.errors import ConfigError

_KEY_HOMES = collect_key_homes(TopLevelConfig)


class DeepSpeedConfig:
    """Parsed DeepSpeed config, frozen once parsed (its sections too); `raw` keeps the user's
    dict for checkpoints (`ds_config`)."""

    def __init__(self, config, dp_world_size=1, source=None):
        """`config`: a dict, a JSON file's path or a base64 string; `source`: how errors
        name a dict that came from a file (default "(dict)")."""
        if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) \
                or dp_world_size < 1:
            raise ValueError(f"dp_world_size must be a positive int, got {dp_world_size!r}")
        raw, loaded_from = load_config_dict(config)
        if source is None or not isinstance(config, dict):
            source = loaded_from
        self.raw = raw
        self.source = source
        self.dp_world_size = dp_world_size
        parsed = parse_section(TopLevelConfig, raw, source, "", key_homes=_KEY_HOMES)
        for f in dataclasses.fields(parsed):
            setattr(self, f.name, getattr(parsed, f.name))
        (self.train_batch_size, self.train_micro_batch_size_per_gpu,
         self.gradient_accumulation_steps) = resolve_batch_sizes(
            parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu,
            parsed.gradient_accumulation_steps, dp_world_size, source)
        # These two checks build the named classes on a dummy parameter, so they import
        # torch; of the rest, only an enabled `compile` section does (its backend's name).
        if self.optimizer is not None:
            from zero.optim.optimizers import check_optimizer_section
            check_optimizer_section(self.optimizer, source)
        if self.scheduler is not None:
            from zero.optim.lr_schedules import check_scheduler_section
            check_scheduler_section(self.scheduler, source)
        self._frozen = True

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"a DeepSpeedConfig is frozen once parsed; cannot set "
                                 f"'{name}' (build a new one from the changed dict instead)")
        super().__setattr__(name, value)

    def settings_ranks_share(self):
        """{key: value} of what every data-parallel rank's config must agree on (the engine
        checks it at initialize): batch sizes, stage, precision, clipping, optimizer, schedule."""
        optimizer, scheduler = self.optimizer, self.scheduler
        return {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization.stage": self.zero_optimization.stage,
            "fp16.enabled": self.fp16.enabled, "bf16.enabled": self.bf16.enabled,
            "gradient_clipping": self.gradient_clipping,
            "optimizer": optimizer and (optimizer.type, sorted(optimizer.params.items())),
            "scheduler": scheduler and (scheduler.type, sorted(scheduler.params.items()))}

    def __repr__(self):
        return (f"DeepSpeedConfig(source={self.source!r}, dp_world_size={self.dp_world_size}, "
                f"train_batch_size={self.train_batch_size}, "
                f"train_micro_batch_size_per_gpu={self.train_micro_batch_size_per_gpu}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
                f"zero_stage={self.zero_optimization.stage}, fp16={self.fp16.enabled}, "
                f"bf16={self.bf16.enabled})")


# ---------------------------------------------------------------------------------------------
# Where the config comes from

def load_config_dict(config):
    """Returns (a fresh dict, a label for error messages) for a dict, path or base64 string."""
    if isinstance(config, dict):
        return copy.deepcopy(config), "(dict)"
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if not isinstance(config, str):
        raise ConfigError(f"DeepSpeed config must be a dict, a path to a JSON file, or a "
                          f"base64-encoded JSON string; got a {type(config).__name__}")
    if os.path.isfile(config):
        return _read_json_file(config), config
    if os.path.isdir(config):
        raise ConfigError(f"DeepSpeed config '{config}' is a directory; give the JSON file")
    decoded = _decode_base64_json(config)
    if decoded is not None:
        return decoded, "(base64 string)"
    raise ConfigError(f"DeepSpeed config file '{config}' does not exist (and the string is not "
                      "base64-encoded JSON either); check the --deepspeed_config path")


def _read_json_file(path):
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read DeepSpeed config '{path}': {e}") from None
    try:
        return _parse_json_object(text, path)
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {e.msg} at line "
                          f"{e.lineno} column {e.colno} (comments and trailing commas are not "
                          "allowed)") from None


def _decode_base64_json(text):
    try:
        decoded = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("utf-8")
        return _parse_json_object(decoded, "(base64 string)")
    except (binascii.Error, ValueError):  # JSONDecodeError and UnicodeDecodeError included
        return None


def _parse_json_object(text, source):
    def reject_duplicates(pairs):
        seen = {}
        duplicates = []
        for key, value in pairs:
            if key in seen and key not in duplicates:
                duplicates.append(key)
            seen[key] = value
        if duplicates:
            raise ConfigError(f"duplicate keys in DeepSpeed config {source}: {duplicates}; JSON "
                              "would keep only the last value, so remove the others")
        return seen

    parsed = json.loads(text, object_pairs_hook=reject_duplicates)
    if not isinstance(parsed, dict):
        raise ConfigError(f"DeepSpeed config {source} must hold a JSON object {{...}}, got "
                          f"a {type(parsed).__name__}")
    return parsed


# ---------------------------------------------------------------------------------------------
# The batch-size rule: train_batch_size = micro_batch * gradient_accumulation_steps * dp_world

def resolve_batch_sizes(train, micro, gas, world, source):
    """DeepSpeed's three-way derivation (deepspeed/runtime/config.py,
    _set_batch_related_parameters), with the arithmetic in every error."""
    for name, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", gas)):
        if value is not None and value <= 0:
            fail(source, f"'{name}' must be > 0, got {value}")
    derivation, divisor = None, None
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // micro // world
        derivation = (f"gradient_accumulation_steps = train_batch_size // "
                      f"train_micro_batch_size_per_gpu // dp_world_size = {train} // {micro} // "
                      f"{world} = {gas}")
        divisor = micro * world
    elif train is not None and gas is not None:
        micro = train // world // gas
        derivation = (f"train_micro_batch_size_per_gpu = train_batch_size // dp_world_size // "
                      f"gradient_accumulation_steps = {train} // {world} // {gas} = {micro}")
        divisor = world * gas
    elif micro is not None and gas is not None:
        train = micro * gas * world
    elif train is not None:
        gas = 1
        micro = train // world
        derivation = (f"gradient_accumulation_steps = 1, train_micro_batch_size_per_gpu = "
                      f"train_batch_size // dp_world_size = {train} // {world} = {micro}")
        divisor = world
    elif micro is not None:
        gas = 1
        train = micro * world
    else:
        fail(source, "set 'train_batch_size' or 'train_micro_batch_size_per_gpu' (or both); "
                     "'gradient_accumulation_steps' alone does not fix the batch size")
    for name, value in (("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", gas)):
        if value <= 0:
            fail(source, f"{derivation}, but '{name}' must be at least 1: train_batch_size "
                         f"({train}) must be a positive multiple of {divisor}")
    if train != micro * gas * world:
        message = (f"train_batch_size must equal train_micro_batch_size_per_gpu * "
                   f"gradient_accumulation_steps * dp_world_size, but {train} != {micro} * {gas}"
                   f" * {world} = {micro * gas * world}")
        if derivation:
            message += (f" (derived {derivation}); train_batch_size must be a multiple of "
                        f"{divisor}")
        else:
            message += "; change one of the three (dp_world_size is the number of data-"\
                       "parallel ranks)"
        fail(source, message)
    return train, micro, gas
