"""~100 randomly mutated published configs: every failure must be a ConfigError.

The mutations are what users do by hand: delete a key, misspell one, put a value of the wrong
kind (null, a string, a list, a huge or negative number, inf) anywhere in the tree. A config
that survives parsing must also build its optimizer, scheduler and loss scaler, or fail with
a ConfigError.
"""

import copy
import random

import torch

from tests.zero import ds_configs
from zero import ConfigError, DeepSpeedConfig, build_loss_scaler, build_lr_scheduler
from zero.optim.optimizers import build_optimizer

JUNK = [None, True, False, 0, -1, 1, 3, 2.5, 1e30, -1e-3, float("inf"), "x", "auto", "",
        "Adam", [], [0.1, 0.2], [1, "a"], {}, {"enabled": True}, {"type": "SGD"}]


def _with_schedule():
    config = ds_configs.tutorial_zero2()
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 100, "warmup_min_lr": 0, "warmup_max_lr": 0.001,
        "warmup_num_steps": 10, "warmup_type": "linear"}}
    config["tensorboard"] = {"enabled": True, "output_path": "runs", "job_name": "x"}
    config["aio"] = {"block_size": 4096, "thread_count": 2}
    config["bf16"] = {"enabled": False}
    return config


def _cosine():
    config = ds_configs.docs_zero_offload()
    config["scheduler"] = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 50, "warmup_num_steps": 5, "cos_min_ratio": 0.1}}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    return config


BASES = ds_configs.ALL + [_with_schedule, _cosine]


def _slots(node, found):
    """Every (parent dict, key) pair in the tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            found.append((node, key))
            _slots(value, found)
    return found


def _misspell(key, rng):
    if len(key) < 3:
        return key + "_"
    i = rng.randrange(len(key) - 1)
    return rng.choice([key[:i] + key[i + 1:], key[:i] + key[i + 1] + key[i] + key[i + 2:],
                       key + "s", key.upper()])


def _mutate(config, rng):
    for _ in range(rng.randint(1, 2)):
        slots = _slots(config, [])
        if not slots:
            return config
        parent, key = rng.choice(slots)
        operation = rng.choice(["delete", "misspell", "junk"])
        if operation == "delete":
            del parent[key]
        elif operation == "misspell":
            parent[_misspell(key, rng)] = parent.pop(key)
        else:
            parent[key] = copy.deepcopy(rng.choice(JUNK))
    return config


def _build_everything(config):
    model = torch.nn.Linear(2, 2)
    if config.optimizer is not None:
        optimizer = build_optimizer(config, model.parameters())
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    build_lr_scheduler(config, optimizer)
    build_loss_scaler(config)


def test_mutated_configs_fail_only_with_config_error():
    rng = random.Random(1234)
    outcomes = {"loaded": 0, "config_error": 0}
    for case in range(100):
        make = BASES[case % len(BASES)]
        config = _mutate(make(), rng)
        world = rng.choice([1, 2, 3, 4])
        try:
            _build_everything(DeepSpeedConfig(config, dp_world_size=world))
            outcomes["loaded"] += 1
        except ConfigError:
            outcomes["config_error"] += 1
        except Exception as e:  # the point of the test: report the config that broke it
            raise AssertionError(f"case {case}: {type(e).__name__}: {e}\nconfig: {config}")
    # both kinds of outcome occur, or the mutations are not exercising the validator
    assert outcomes["config_error"] >= 30 and outcomes["loaded"] >= 10, outcomes
