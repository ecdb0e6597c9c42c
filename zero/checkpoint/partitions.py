"""Stage 0-2 optimizer state in DeepSpeed's partitioning, from and to the engine's.

In memory a param group's flat buffer is cut into K buckets whose chunk n belongs to rank n
(zero/stages/flat_buffers.py); DeepSpeed's files cut the same flat group, padded to a multiple of
2·dp, into dp contiguous slices. `zero_optimizer_state` gathers each bucket once to cut this
rank's DeepSpeed slice out of the masters and per-element optimizer states (collective over
DP); `PartitionRestore` copies, slice by saved slice, the elements this rank owns back, so a
checkpoint loads at any data-parallel size and from any ZeRO stage 0-2. The files around them
(names, atomic saves, reading) are zero/checkpoint/layout.py's.
"""

import math

import torch

from zero.errors import CheckpointError
from zero.optim.quantized_state import TABLE as QUANTIZED_TABLE
from zero.optim.quantized_state import merge_tables

DS_VERSION = "0.16.5+zero"  # the DeepSpeed release whose layout these files reproduce


def natural_partition_numel(numel, world_size):
    """DeepSpeed's slice size: the group padded to a multiple of 2·world, cut into `world`."""
    align = 2 * world_size
    return math.ceil(numel / align) * align // world_size



def zero_optimizer_state(optimizer):
    """This rank's optimizer state in DeepSpeed's stage 1/2 format (collective over DP)."""
    base = optimizer.base_state_dict()  # offload: swapped in from host/NVMe
    state, fp32_groups, paddings, counts = {}, [], [], []
    for g, group in enumerate(optimizer.groups):
        comm = optimizer.dp_comm if group.layout.world_size > 1 else None
        natural = partial_natural_partition(group, comm)
        state[g] = {key: natural(value) if _per_element(value, group.layout.partition_numel)
                    else _on_cpu(value) for key, value in base["state"].get(g, {}).items()}
        size = natural_partition_numel(group.layout.numel, group.layout.world_size)
        valid = max(0, min(size, group.layout.numel - group.rank * size))
        if optimizer.settings.stage > 0 or not group.master_is_flat:
            # (fp32 stage 0 leaves it out: the master is the module's weights)
            fp32_groups.append(natural(optimizer.master_partition(g))[:valid])
        paddings.append(size - valid)
        counts.append(group.layout.world_size)
    scaler = optimizer.loss_scaler
    result = {
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "dynamic_loss_scale": bool(getattr(scaler, "dynamic", False)),
        "overflow": optimizer.overflow,
        "clip_grad": optimizer.settings.gradient_clipping,
        "base_optimizer_state": {"state": state, "param_groups": base["param_groups"]},
        "zero_stage": optimizer.settings.stage,
        "group_paddings": paddings,
        "partition_count": counts,
        "ds_version": DS_VERSION,
    }
    if len(fp32_groups) == len(optimizer.groups):
        result["single_partition_of_fp32_groups"] = fp32_groups
    return result


def _on_cpu(value):
    return value.to("cpu") if torch.is_tensor(value) else value


def _per_element(value, partition_numel):
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == partition_numel


def partial_natural_partition(group, comm):
    """A function: tensor in the engine's partition layout [K·C] -> this rank's DeepSpeed
    slice (zero padded). Collective over `comm` when there are several partitions."""
    lay = group.layout
    size = natural_partition_numel(lay.numel, lay.world_size)
    lo = group.rank * size
    hi = min(lo + size, lay.numel)

    def natural(tensor):
        if comm is None:  # one partition: the layouts agree on a prefix (zeros past numel)
            return tensor.narrow(0, 0, size).to("cpu")
        out = torch.zeros(size, dtype=tensor.dtype, device="cpu")
        for k in range(lay.num_buckets):
            bucket = torch.empty(lay.bucket, dtype=tensor.dtype, device=tensor.device)
            comm.all_gather(bucket, tensor.narrow(0, k * lay.chunk, lay.chunk))
            a, b = max(lo, k * lay.bucket), min(hi, (k + 1) * lay.bucket)
            if a < b:
                out.narrow(0, a - lo, b - a).copy_(bucket.narrow(0, a - k * lay.bucket, b - a))
        return out
    return natural


def check_param_shapes(engine, saved, ckpt_dir):
    names = {p: n for n, p in engine.module.named_parameters()}
    current = [[(names[p], tuple(p.shape)) for p in g.params] for g in engine.optimizer.groups]
    saved = [[(n, tuple(s)) for n, s in group.items()] for group in (saved or [])]
    if saved != current:
        raise CheckpointError(
            f"the optimizer parameter groups in {ckpt_dir} ({[len(g) for g in saved]} params "
            f"per group) do not match this model's ({[len(g) for g in current]}), or names or "
            "shapes differ; pass load_optimizer_states=False (pretrain_gpt2.py: "
            "--no-load-optim) to load the weights only")


class PartitionRestore:
    """Copies, slice by saved slice, the elements this rank owns into masters and states."""

    def __init__(self, optimizer, use_fp32_weights):
        self.optimizer = optimizer
        self.states = [{} for _ in optimizer.groups]
        self.has_fp32 = use_fp32_weights
        self.first = None

    def take(self, s, saved, count):
        groups = self.optimizer.groups
        if s == 0:
            self.first = saved
            if len(saved.get("partition_count", [])) != len(groups):
                raise CheckpointError(f"the checkpoint has {len(saved.get('partition_count', []))}"
                                      f" parameter groups, the optimizer {len(groups)}")
        self.has_fp32 &= "single_partition_of_fp32_groups" in saved
        base_state = saved["base_optimizer_state"]["state"]
        for g, group in enumerate(groups):
            numel = group.layout.numel
            size = natural_partition_numel(numel, saved["partition_count"][g])
            lo, hi = s * size, min((s + 1) * size, numel)
            runs = group.layout.partition_runs(group.rank, lo, hi)
            if self.has_fp32:
                self._copy_runs(saved["single_partition_of_fp32_groups"][g],
                                self.optimizer.master_restore_target(g),
                                runs, lo)
            for key, value in base_state.get(g, {}).items():
                if _per_element(value, size):
                    target = self.states[g].setdefault(
                        key, torch.zeros(group.layout.partition_numel, dtype=value.dtype))
                    self._copy_runs(value, target, runs, lo)
                elif key == QUANTIZED_TABLE:  # every saved rank's runs, named by parameter
                    self.states[g][key] = merge_tables([self.states[g].get(key), value])
                elif s == 0:
                    self.states[g][key] = value.clone() if torch.is_tensor(value) else value

    @staticmethod
    def _copy_runs(source, target, runs, lo):
        with torch.no_grad():
            for flat_start, part_start, length in runs:
                source_run = source.narrow(0, flat_start - lo, length)
                target.narrow(0, part_start, length).copy_(source_run)

    def finish(self):
        optimizer, saved = self.optimizer, self.first
        optimizer.load_saved_state(
            {"state": {g: s for g, s in enumerate(self.states) if s},
             "param_groups": saved["base_optimizer_state"]["param_groups"]},
            saved.get("loss_scaler"))
        if self.has_fp32:
            optimizer.commit_restored_masters()
        return self.has_fp32


@torch.no_grad()
def restore_whole_params(optimizer, saved, names, with_state, strict):
    """Fill this rank's partition of the masters (and, `with_state`, the optimizer state)
    parameter by parameter from `saved` (zero/checkpoint/whole_params.py: a checkpoint of any
    stage, stage 3's included; zero/checkpoint/restore.py checks its param groups first).
    Returns the names the checkpoint lacks (not `strict`: they keep their values and start
    with zero optimizer state)."""
    missing = [names[p] for group in optimizer.groups for p in group.params
               if not saved.has(names[p])]
    if missing and strict:
        raise CheckpointError(f"{saved.ckpt_dir} has no saved values for parameter(s) "
                              f"{missing[:5]}; the model differs from the saved one "
                              "(load_module_strict=False keeps their values)")
    states = [{} for _ in optimizer.groups]
    for g, group in enumerate(optimizer.groups):
        lay, master = group.layout, optimizer.master_restore_target(g)
        tables = []
        for i, (param, offset, numel) in enumerate(zip(group.params, lay.offsets, lay.numels)):
            name = names[param]
            runs = [(start - offset, part, length) for start, part, length
                    in lay.partition_runs(group.rank, offset, offset + numel)]
            saved_master = saved.master(name, numel) if saved.has(name) else None
            if saved_master is None:  # kept (not strict), or the loaded weights are the master
                _copy_param_runs(group.flat.narrow(0, offset, numel).float(), master, runs)
                if not saved.has(name):
                    continue
            else:
                _copy_param_runs(saved_master, master, runs)
            if not with_state:
                continue
            for key, dtype in saved.per_element_keys(name).items():
                target = states[g].setdefault(key, torch.zeros(lay.partition_numel, dtype=dtype))
                _copy_param_runs(saved.state(name, key, numel), target, runs)
            for key, value in saved.scalar_state(name).items():
                if key not in states[g]:
                    states[g][key] = value.clone() if torch.is_tensor(value) else value
            tables.append(saved.table(name, optimizer.piece_name(g, i)))
        if any(t is not None for t in tables):
            states[g][QUANTIZED_TABLE] = merge_tables(tables)
    if with_state:
        optimizer.load_saved_state(
            {"state": {g: s for g, s in enumerate(states) if s},
             "param_groups": [{**saved_group, "params": [g]}
                              for g, saved_group in enumerate(saved.param_groups)]},
            saved.loss_scaler)
    optimizer.commit_restored_masters()
    return missing


def _copy_param_runs(source, target, runs):
    """target[part:part+length] <- source[start:start+length] for each (start, part, length)."""
    for start, part, length in runs:
        target.narrow(0, part, length).copy_(source.narrow(0, start, length))
