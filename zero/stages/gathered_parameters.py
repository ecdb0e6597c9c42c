"""`zero.GatheredParameters` (DeepSpeed's): ZeRO-3 parameters gathered whole for a block of
user code, and, with `modifier_rank`, that rank's edits re-partitioned on every rank."""

import operator

import torch

from zero.errors import ZeroError
from zero.stages.partition_parameters import (ParamStatus, gather_params, is_zero_param,
                                              register_external_parameter, release_param,
                                              repartition_from_full)


def _group_rank(rank, size):
    """`rank` (any integer, numpy's too) if it is a rank of a group of `size`."""
    try:
        index = None if isinstance(rank, bool) else operator.index(rank)
    except TypeError:
        index = None
    if index is None or not 0 <= index < size:
        raise ZeroError(f"GatheredParameters: modifier_rank {rank!r} is not a rank of the "
                        f"parameters' data-parallel group (0..{size - 1})")
    return index


class GatheredParameters:
    """Gather ZeRO parameters for the duration of the block (DeepSpeed's API).

        with zero.GatheredParameters(model.fc.weight, modifier_rank=0):
            if rank == 0:
                model.fc.weight.fill_(1.0)

    With `modifier_rank`, that rank's values are broadcast and every rank re-partitions them
    on exit; the stage 3 optimizer's fp32 master follows (unlike DeepSpeed, where the next step
    would overwrite the edit). Without it, edits are discarded. Non-ZeRO parameters are
    ignored. `fwd_module` registers the parameters as external parameters of that module.
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        unique = {}
        for param in params if params is not None else []:
            if is_zero_param(param):
                unique[param.ds_id] = param
        self.params = [unique[k] for k in sorted(unique)]  # the same order on every rank
        self.enabled = enabled and bool(self.params)
        if self.enabled and modifier_rank is not None:
            modifier_rank = _group_rank(modifier_rank, self.params[0].ds_comm.world_size)
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self._was_gathered = []

    def __enter__(self):
        if not self.enabled:
            return self
        self._was_gathered = [p.ds_status is ParamStatus.AVAILABLE for p in self.params]
        gather_params(self.params)
        if self.fwd_module is not None:
            for param in self.params:
                register_external_parameter(self.fwd_module, param)
        return self

    def __exit__(self, exc_type, *exc):
        if not self.enabled:
            return False
        if self.modifier_rank is not None and exc_type is None:
            with torch.no_grad():
                for param in self.params:
                    param.ds_comm.broadcast(param.ds_full, src_group_rank=self.modifier_rank)
                    repartition_from_full(param)
        for param, was_gathered in zip(self.params, self._was_gathered):
            if not was_gathered:
                release_param(param)
        return False
