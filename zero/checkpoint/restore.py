"""Put a checkpoint read one whole parameter at a time (the readers of
zero/checkpoint/whole_params.py and per_parameter.py) into an engine at any ZeRO stage: stage 3
cuts each parameter's piece (zero/checkpoint/stage3.py), stages 0-2 the runs of their flat
partitions (zero/checkpoint/partitions.py).
"""

from zero.checkpoint.partitions import restore_whole_params
from zero.checkpoint.stage3 import group_names, restore_stage3
from zero.checkpoint.whole_params import check_param_groups


def restore_optimizer(engine, saved, with_state=True, strict=True):
    """The engine's fp32 masters (and, `with_state`, its optimizer state and loss scale) from
    the reader `saved`. Returns the names `saved` lacks (not `strict`: they keep their
    values)."""
    if engine.zero_optimization_stage() == 3:
        return restore_stage3(engine.optimizer, saved, with_state, strict)
    if with_state:
        check_param_groups(saved, engine_names_per_group(engine))
    names = {p: n for n, p in engine.module.named_parameters()}
    return restore_whole_params(engine.optimizer, saved, names, with_state, strict)


def engine_names_per_group(engine):
    """[the names of each optimizer param group's parameters, in the group's order]."""
    if engine.zero_optimization_stage() == 3:
        return group_names(engine.optimizer)
    names = {p: n for n, p in engine.module.named_parameters()}
    return [[names[p] for p in group.params] for group in engine.optimizer.groups]
