"""ZeRO-Offload for stages 1 and 2: the fp32 master partition and Adam's state leave the device.

    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    "zero_optimization": {"stage": 2, "sub_group_size": 1e8,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                                                "pipeline_read": true, "pipeline_write": true}}

Compared with `ZeroOptimizer` (zero/stages/stage1_2.py), which this extends:
- each param group's fp32 master and its reduced gradient are separate host tensors (pinned
  with pin_memory on CUDA), also where the plain engine would share the model's fp32 buffer;
- the optimizer is `zero.ops.CPUAdam` (a torch Adam/AdamW is converted, keeping its param-group
  dicts so LR schedules still act); it steps the partition one `sub_group_size` piece at a time
  through an optimizer-state store (zero/offload/state_store.py) and writes each updated tile
  straight into this rank's chunks of the model's flat buffer (16-bit or device copy in the
  same pass); one all-gather per bucket then rebuilds the model weights, as without offload;
- device "nvme": master and moments live in swap files; memory holds `buffer_count` sub-groups.

Checkpoints hold the swapped-in state as plain tensors in DeepSpeed's layout (zero/checkpoint/layout.py
asks through `master_partition` / `base_state_dict` / `master_restore_target` /
`load_base_state_dict`), so resuming is exact and does not need the swap folder.
"""

from dataclasses import dataclass
from functools import partial

import torch

from zero.errors import ConfigError
from zero.stages.flat_buffers import FlatGroup
from zero.offload.host_step import HostStepStates, as_cpu_adam
from zero.ops.cpu_adam import CPUAdam
from zero.stages.stage1_2 import ZeroOptimizer


@dataclass
class OptimizerOffload:
    """The resolved `offload_optimizer` section plus what the store needs to know."""
    device: str  # "cpu" | "nvme"
    nvme_path: str = None
    pin_memory: bool = False
    buffer_count: int = 4
    fast_init: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    sub_group_size: int = 1_000_000_000
    aio: object = None  # zero.config.sections.AioConfig
    global_rank: int = 0
    stage: int = 2

    @classmethod
    def from_config(cls, config, global_rank):
        zero = config.zero_optimization
        section = zero.offload_optimizer
        return cls(device=section.device, nvme_path=section.nvme_path,
                   pin_memory=section.pin_memory, buffer_count=section.buffer_count,
                   fast_init=section.fast_init, pipeline_read=section.pipeline_read,
                   pipeline_write=section.pipeline_write, sub_group_size=zero.sub_group_size,
                   aio=config.aio, global_rank=global_rank, stage=zero.stage)

    @property
    def host_pinned(self):
        return self.pin_memory and torch.cuda.is_available()


class HostMasterGroup(FlatGroup):
    """A FlatGroup whose fp32 master and master gradient are host tensors of their own."""

    def __init__(self, params, layout, rank, keep_full_grads, offload):
        self.offload = offload
        super().__init__(params, layout, rank, keep_full_grads)

    def _make_master(self):
        numel, pin = self.layout.partition_numel, self.offload.host_pinned
        if self.offload.device == "nvme":  # the master lives in the swap files; no storage here
            master = torch.nn.Parameter(torch.empty(numel, dtype=torch.float32))
            master.data.untyped_storage().resize_(0)
        else:
            master = torch.nn.Parameter(torch.empty(numel, dtype=torch.float32, pin_memory=pin))
            with torch.no_grad():
                master.view(self.layout.num_buckets, self.layout.chunk).copy_(
                    self.own_chunks(self.flat))
        master.grad = torch.zeros(numel, dtype=torch.float32, pin_memory=pin)
        return master


class OffloadZeroOptimizer(HostStepStates, ZeroOptimizer):
    """ZeroOptimizer whose optimizer step runs on the host (CPUAdam over a state store)."""

    def __init__(self, optimizer, param_order, settings, dp_comm, mp_comm=None, mp_rank=0,
                 loss_scaler=None, offload=None):
        if settings.stage not in (1, 2):
            raise ConfigError(f"offload_optimizer needs ZeRO stage 1, 2 or 3; this engine got "
                              f"stage {settings.stage}")
        self.offload = offload
        super().__init__(optimizer, param_order, settings, dp_comm, mp_comm, mp_rank,
                         loss_scaler)

    # ----- construction (hooks of ZeroOptimizer) -----

    def _alias_master_in_flat(self, dtype):
        return False  # the master lives on the host (or NVMe), never in the model's buffer

    def _new_group(self, params, layout, alias_master=False):
        return HostMasterGroup(params, layout, self.partition_rank, self.settings.stage < 2,
                               self.offload)

    def _use_fused_adam(self):
        """Replace the optimizer by CPUAdam and build the state store (instead of fused)."""
        self.optimizer = as_cpu_adam(self.optimizer)
        self._hyper = [group for group in self.optimizer.param_groups if group["params"]]
        self._build_state_store(self.offload.stage)

    def _host_masters(self):
        return [group.master for group in self.groups]

    # ----- step -----

    def _step_partitions(self):
        """Step every sub-group on the host, writing updated tiles into the model's flat
        buffer as they are computed; then all-gather the buckets."""
        for g, group in enumerate(self.groups):
            step = self.store.step_tensor(g)
            step += 1
            grad = group.master.grad
            for sub in self.store.sub_groups(g):
                CPUAdam.update(sub.master, grad[sub.lo:sub.hi], sub.state(step), self._hyper[g],
                               on_tile=partial(self._write_own_chunks, group, sub.lo))
        self._all_gather_own_chunks()

    def _write_own_chunks(self, group, base, lo, hi, updated):
        """Partition elements [base+lo, base+hi) (fp32, host) -> this rank's chunks of the
        model's flat buffer (model dtype and device)."""
        chunk = group.layout.chunk
        own = group.own_chunks(group.flat)  # [K, C]
        start, end, done = base + lo, base + hi, 0
        while start < end:
            k, offset = divmod(start, chunk)
            length = min(end - start, chunk - offset)
            own[k, offset:offset + length].copy_(updated[done:done + length],
                                                 non_blocking=self.offload.host_pinned)
            start, done = start + length, done + length

    def _all_gather_own_chunks(self):
        if self.offload.host_pinned:
            torch.cuda.current_stream().synchronize()  # the non-blocking tile copies
        pendings = []
        for group in self.groups:
            lay = group.layout
            if lay.world_size == 1:
                continue
            own = group.own_chunks(group.flat)
            for k in range(lay.num_buckets):
                pendings.append(self.dp_comm.all_gather(group.flat_bucket(group.flat, k), own[k],
                                                        async_op=True))
        for pending in pendings:
            pending.wait()

    # ----- masters <-> model weights -----

    @torch.no_grad()
    def publish_masters(self):
        for g, group in enumerate(self.groups):
            for sub in self.store.sub_groups(g):
                self._write_own_chunks(group, sub.lo, 0, sub.hi - sub.lo, sub.master)
        self._all_gather_own_chunks()

    @torch.no_grad()
    def refresh_masters_from_model(self):
        self._restored_masters = {}
        for g, group in enumerate(self.groups):
            own = group.own_chunks(group.flat)
            for k in range(group.layout.num_buckets):
                self.store.write_range(g, "master", k * group.layout.chunk, own[k].float())
