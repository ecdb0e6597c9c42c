"""ZeRO-Offload for stages 1 and 2: the fp32 master partition and Adam's state leave the device.

    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    "zero_optimization": {"stage": 2, "sub_group_size": 1e8,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                                                "pipeline_read": true, "pipeline_write": true}}

Compared with `ZeroOptimizer` (zero/stage1_2.py), which this extends:
- each param group's fp32 master and its reduced gradient are separate host tensors (pinned
  with pin_memory on CUDA), also where the plain engine would share the model's fp32 buffer;
- the optimizer is `zero.ops.CPUAdam` (a torch Adam/AdamW is converted, keeping its param-group
  dicts so LR schedules still act); it steps the partition one `sub_group_size` piece at a time
  through an optimizer-state store (zero/offload/state_store.py) and writes each updated tile
  straight into this rank's chunks of the model's flat buffer (16-bit or device copy in the
  same pass); one all-gather per bucket then rebuilds the model weights, as without offload;
- device "nvme": master and moments live in swap files; memory holds `buffer_count` sub-groups.

Checkpoints hold the swapped-in state as plain tensors in DeepSpeed's layout (zero/checkpoint.py
asks through `master_partition` / `base_state_dict` / `master_restore_target` /
`load_base_state_dict`), so resuming is exact and does not need the swap folder.
"""

import logging
import weakref
from dataclasses import dataclass
from functools import partial

import torch

from zero.errors import ConfigError
from zero.flat_buffers import FlatGroup
from zero.offload.state_store import NvmeStateStore, ResidentStateStore
from zero.offload.swap_dir import (agree_on_errors, check_nvme_path, fresh_swap_dir,
                                   remove_swap_dir, swap_dir_for)
from zero.ops.cpu_adam import CPUAdam
from zero.stage1_2 import ZeroOptimizer

logger = logging.getLogger("zero.offload")


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
    aio: object = None  # zero.config_sections.AioConfig
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


class OffloadZeroOptimizer(ZeroOptimizer):
    """ZeroOptimizer whose optimizer step runs on the host (CPUAdam over a state store)."""

    def __init__(self, optimizer, param_order, settings, dp_comm, mp_comm=None, mp_rank=0,
                 loss_scaler=None, offload=None):
        if settings.stage not in (1, 2):
            raise ConfigError(f"offload_optimizer needs ZeRO stage 1, 2 or 3; this engine got "
                              f"stage {settings.stage}")
        self.offload = offload
        self._restored_masters = {}
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
        self.optimizer = _as_cpu_adam(self.optimizer)
        self._hyper = [group for group in self.optimizer.param_groups if group["params"]]
        if self.offload.device == "nvme":
            self.store = self._nvme_store()
        else:
            self.store = ResidentStateStore(self.optimizer, self.offload.sub_group_size)
            for g, group in enumerate(self.groups):
                self.store.add(g, group.master)

    def _nvme_store(self):
        o = self.offload
        swap_dir = swap_dir_for(o.nvme_path, o.stage, "optimizer", o.global_rank)
        needed = sum(3 * 4 * group.layout.partition_numel for group in self.groups)
        error = None
        try:
            check_nvme_path(o.nvme_path, needed, swap_dir,
                            "zero_optimization.offload_optimizer.nvme_path")
        except ConfigError as e:
            error = e
        agree_on_errors(error)  # before any file is written, on every rank
        fresh_swap_dir(swap_dir)
        store = NvmeStateStore(swap_dir, o.aio, o.sub_group_size, o.buffer_count,
                               o.pipeline_read, o.pipeline_write, o.pin_memory)
        # removed by engine.destroy(), else at exit (grad hooks keep the optimizer alive)
        self._remove_swap_files = weakref.finalize(self, _remove_swap_dir, store, swap_dir)
        for g, group in enumerate(self.groups):
            store.add(g, group.layout.partition_numel, fast_init=o.fast_init)
        self.store = store
        self.refresh_masters_from_model()
        logger.info("optimizer states of %d elements swap to %s", needed // 12, swap_dir)
        return store

    def close(self):
        """Delete the swap files (NVMe); the optimizer is unusable afterwards."""
        finalizer = getattr(self, "_remove_swap_files", None)
        if finalizer is not None:
            finalizer()

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

    # ----- checkpoints (see zero/checkpoint.py) -----

    def master_partition(self, g):
        return self.store.read(g, "master")

    def base_state_dict(self):
        saved = self.optimizer.state_dict()
        if self.offload.device == "nvme":  # swap the state in, as plain tensors
            saved["state"] = {g: {"step": self.store.step_tensor(g).clone(),
                                  "exp_avg": self.store.read(g, "exp_avg"),
                                  "exp_avg_sq": self.store.read(g, "exp_avg_sq")}
                              for g in range(len(self.groups))}
        return saved

    def master_restore_target(self, g):
        if self.offload.device != "nvme":
            return self.groups[g].master.data
        if g not in self._restored_masters:  # filled slice by saved slice, then committed
            self._restored_masters[g] = torch.zeros(self.groups[g].layout.partition_numel,
                                                    dtype=torch.float32)
        return self._restored_masters[g]

    def load_base_state_dict(self, state_dict):
        if self.offload.device != "nvme":
            self.optimizer.load_state_dict(state_dict)
            return
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for g, state in state_dict["state"].items():
            self.store.step_tensor(g).copy_(state["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                self.store.write_range(g, name, 0, state[name])

    def commit_restored_masters(self):
        for g, master in self._restored_masters.items():
            self.store.write_range(g, "master", 0, master)
        self._restored_masters = {}


def _as_cpu_adam(optimizer):
    if isinstance(optimizer, CPUAdam):
        return optimizer
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return CPUAdam.from_torch(optimizer)
    raise ConfigError(f"offload_optimizer steps the optimizer with zero.ops.CPUAdam, so the "
                      f"optimizer must be Adam or AdamW (or CPUAdam); got "
                      f"{type(optimizer).__name__}. Remove offload_optimizer to use it")


def _remove_swap_dir(store, swap_dir):
    store.close()
    remove_swap_dir(swap_dir)
