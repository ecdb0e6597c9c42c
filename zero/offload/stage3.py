"""ZeRO-Offload / ZeRO-Infinity at stage 3: the sub-groups' fp32 masters and Adam moments on
the host ("cpu") or in swap files ("nvme"), stepped by CPUAdam one sub-group at a time.

    "zero_optimization": {"stage": 3, "sub_group_size": 1e6,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                "pipeline_read": true, "pipeline_write": true},
                          "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}

Compared with `Stage3Optimizer` (zero/stages/stage3.py), which this extends:
- each sub-group's master is a host fp32 tensor of its own ("cpu"), or lives in the
  optimizer-state store's files ("nvme": zero/offload/state_store.py, which swaps master +
  moments per sub_group_size piece with overlapped reads and write-backs); the reduced fp32
  partition gradient stays in memory (4 bytes per element of this rank's partition);
- the step runs CPUAdam over the store and writes each updated tile straight into the
  partitions: into the sub-group's flat buffer of model dtype, or -- when the parameter shards
  are swapped (offload_param "nvme") -- into the shards' swap files, asynchronously, so no
  flat buffer of the partitions exists in memory at all.
Checkpoints ask through `master_partition` / `base_state_dict` / `master_restore_target` /
`load_base_state_dict`, so the swapped state is saved as plain tensors (DeepSpeed's layout).
"""

import bisect
from functools import partial

import torch

from zero.offload.host_step import HostStepStates, as_cpu_adam
from zero.offload.param_swapper import is_swapped, read_shard
from zero.ops.cpu_adam import CPUAdam
from zero.stages.stage3 import Stage3Optimizer, SubGroup


class HostSubGroup(SubGroup):
    """A stage 3 sub-group whose fp32 master is not the partitions' buffer.

    Partitions in memory: `flat` (model dtype) holds them and `ds_tensor`s are its views, as in
    SubGroup. Swapped partitions (offload_param nvme): `flat` is None and each parameter's shard
    stays in its swap file. `master` is a host fp32 tensor ("cpu") or storage-less ("nvme").
    """

    def __init__(self, params, mp_rank, master_in_memory):
        self.params = params
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        total = sum(self.sizes)
        self.swapped = [is_swapped(p) for p in params]
        self.flat = None
        if not any(self.swapped):
            self.flat = torch.empty(total, dtype=params[0].ds_tensor.dtype,
                                    device=params[0].ds_tensor.device)
            with torch.no_grad():
                for param, offset, size in zip(params, self.offsets, self.sizes):
                    view = self.flat.narrow(0, offset, size)
                    view.copy_(param.ds_tensor)
                    param.ds_tensor = view
        self.master = torch.nn.Parameter(torch.empty(total, dtype=torch.float32))
        if master_in_memory:
            with torch.no_grad():
                for piece, offset in self.partitions():
                    self.master.narrow(0, offset, piece.numel()).copy_(piece)
        else:  # the values live in the store's files
            self.master.data.untyped_storage().resize_(0)
        self.master.grad = torch.zeros(total, dtype=torch.float32)
        self.replicated_runs = [] if mp_rank == 0 else [
            (o, s) for p, o, s in zip(params, self.offsets, self.sizes)
            if not (getattr(p, "model_parallel", False)
                    or getattr(p, "tensor_model_parallel", False))]

    @property
    def master_is_flat(self):
        return False

    def partitions(self):
        """(this rank's piece of each parameter in memory, its offset), one at a time."""
        for param, offset in zip(self.params, self.offsets):
            yield read_shard(param), offset

    @torch.no_grad()
    def write_tile(self, start, updated, pending):
        """Partition elements [start, start + len(updated)) <- updated (fp32)."""
        if self.flat is not None:
            self.flat.narrow(0, start, updated.numel()).copy_(updated)
            return
        end = start + updated.numel()
        i = bisect.bisect_right(self.offsets, start) - 1
        while i < len(self.params) and self.offsets[i] < end:
            param, offset = self.params[i], self.offsets[i]
            lo, hi = max(start, offset), min(end, offset + self.sizes[i])
            values = updated[lo - start:hi - start]
            if self.swapped[i]:
                pending.append(param.ds_swapper.write(param, values, lo - offset))
            else:
                param.ds_tensor.narrow(0, lo - offset, hi - lo).copy_(values)
            i += 1


class OffloadStage3Optimizer(HostStepStates, Stage3Optimizer):
    """Stage3Optimizer whose step runs on the host (CPUAdam over an optimizer-state store)."""

    frees_partition_grads = False  # the host gradient buffers persist (allocated once, pinned)

    def __init__(self, optimizer, module, settings, dp_comm, mp_comm=None, mp_rank=0,
                 loss_scaler=None, offload=None):
        self.offload = offload
        super().__init__(optimizer, module, settings, dp_comm, mp_comm, mp_rank, loss_scaler)

    # ----- construction (hooks of Stage3Optimizer) -----

    def _new_sub_group(self, params):
        return HostSubGroup(params, self.mp_rank, master_in_memory=self.offload.device == "cpu")

    def _use_fused_adam(self):
        """Replace the optimizer by CPUAdam and build the state store (instead of fused)."""
        self.optimizer = as_cpu_adam(self.optimizer)
        group_of = {id(p): group for group in self.optimizer.param_groups
                    for p in group["params"]}
        self._hyper = [group_of[id(g.master)] for g in self.sub_groups]
        self._build_state_store(3)

    def _host_masters(self):
        return [sub_group.master for sub_group in self.sub_groups]

    def close(self):
        """Delete the swap files (optimizer states and parameter shards)."""
        super().close()
        for param in self.location:
            if is_swapped(param):
                param.ds_swapper.forget([param])

    # ----- step -----

    def _step_partitions(self):
        """Step every sub-group on the host; each updated tile goes straight into the
        partitions (flat buffer, or the shards' swap files, written in the background)."""
        pending = []
        for key, sub_group in enumerate(self.sub_groups):
            step = self.store.step_tensor(key)
            step += 1
            grad = sub_group.master.grad
            for sub in self.store.sub_groups(key):
                CPUAdam.update(sub.master, grad[sub.lo:sub.hi], sub.state(step), self._hyper[key],
                               on_tile=partial(self._on_tile, sub_group, sub.lo, pending))
        for p in pending:
            p.wait()

    @staticmethod
    def _on_tile(sub_group, base, pending, lo, hi, updated):
        sub_group.write_tile(base + lo, updated, pending)

    def _partition_updated(self, param):
        """GatheredParameters(modifier_rank=...) changed param's partition: follow in fp32."""
        sub_group, offset = self.location[param]
        self.store.write_range(self.sub_groups.index(sub_group), "master", offset,
                               read_shard(param).float())

    # ----- masters <-> partitions -----

    @torch.no_grad()
    def publish_masters(self):
        pending = []
        for key, sub_group in enumerate(self.sub_groups):
            for sub in self.store.sub_groups(key):
                sub_group.write_tile(sub.lo, sub.master, pending)
        for p in pending:
            p.wait()

    @torch.no_grad()
    def refresh_masters_from_model(self):
        self._restored_masters = {}
        for key, sub_group in enumerate(self.sub_groups):
            for piece, offset in sub_group.partitions():
                self.store.write_range(key, "master", offset, piece.float())

    # ----- accounting -----

    def model_state_bytes(self):
        def nbytes(t):
            return t.untyped_storage().nbytes() if t is not None else 0
        partitions = sum(nbytes(g.flat) for g in self.sub_groups)
        partitions += sum(nbytes(p.ds_tensor) for g in self.sub_groups
                          for p, s in zip(g.params, g.swapped) if s)  # (0: swapped)
        gathered = sum(nbytes(p.ds_full) for p in self.coordinator.owner
                       if p.ds_full is not None)
        return {"parameters": partitions,
                "gradients": sum(nbytes(g.master.grad) for g in self.sub_groups),
                "master_weights": sum(nbytes(g.master) for g in self.sub_groups),
                "optimizer_states": self.store.resident_bytes()
                if self.offload.device == "nvme" else
                sum(2 * nbytes(g.master) for g in self.sub_groups),
                "gathered_parameters": gathered}

