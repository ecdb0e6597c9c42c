"""ZeRO-Offload / ZeRO-Infinity for the optimizer: a master store (zero/stages/masters.py)
whose fp32 masters and Adam moments live in host memory ("cpu") or in NVMe swap files
("nvme"), stepped by CPUAdam one `sub_group_size` piece at a time.

    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    "zero_optimization": {"stage": 3, "sub_group_size": 1e6,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                "pipeline_read": true, "pipeline_write": true}}

Any ZeRO stage 1-3 composes with it: the stage keeps the partitions, their gradients (host
tensors here, pinned with pin_memory on CUDA) and the communication; each updated tile goes
straight back into the stage's partition through its write_back (16-bit or device copy in
the same pass). With "nvme" the state is in three files per key under
`<nvme_path>/zero_stage_<s>/optimizer/rank<R>/` (zero/offload/state_store.py), `buffer_count`
sub-groups in memory at a time. Checkpoints hold the swapped-in state as plain tensors, so
resuming does not need the swap folder.

Adam8bit / Adam4bit (zero/optim/quantized_adam.py) step the masters themselves and keep
their quantised state (about 2 / 1 bytes per element) in host memory; with "nvme" only the
fp32 masters swap, one key at a time: 8 bytes per element move per step instead of CPUAdam's
24. A key is a stage-3 sub-group, but a whole stage-1/2 partition: there the step holds that
partition's master in memory, as "cpu" does (sub_group_size does not split it).
"""

import logging
import weakref
from dataclasses import dataclass

import torch

from zero.errors import ConfigError
from zero.offload.state_store import STATE_NAMES, NvmeStateStore, ResidentStateStore
from zero.offload.swap_dir import (agree_on_errors, check_nvme_path, fresh_swap_dir,
                                   remove_swap_dir, swap_dir_for)
from zero.ops.cpu_adam import CPUAdam
from zero.stages.masters import divide_grads, saved_state_of

logger = logging.getLogger("zero.offload")

@dataclass(frozen=True)
class OptimizerOffload:
    """The resolved `offload_optimizer` section plus what the store needs to know."""
    device: str  # "cpu" | "nvme"
    nvme_path: str
    pin_memory: bool
    buffer_count: int
    fast_init: bool
    pipeline_read: bool
    pipeline_write: bool
    sub_group_size: int
    aio: object  # zero.config.sections.AioConfig
    global_rank: int
    stage: int

    @classmethod
    def from_config(cls, config, global_rank):
        zero = config.zero_optimization
        section = zero.offload_optimizer
        return cls(device=section.device, nvme_path=section.nvme_path,
                   pin_memory=section.pin_memory, buffer_count=section.buffer_count,
                   fast_init=section.fast_init, pipeline_read=section.pipeline_read,
                   pipeline_write=section.pipeline_write, sub_group_size=zero.sub_group_size,
                   aio=config.aio, global_rank=global_rank, stage=zero.stage)


def as_cpu_adam(optimizer):
    if isinstance(optimizer, CPUAdam):
        return optimizer
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return CPUAdam.from_torch(optimizer)
    raise ConfigError(f"offload_optimizer steps the optimizer with zero.ops.CPUAdam, so the "
                      f"optimizer must be Adam or AdamW (or CPUAdam); got "
                      f"{type(optimizer).__name__}. Remove offload_optimizer to use it")


class HostMasters:
    """The master store of offload_optimizer (see zero/stages/masters.py for the protocol)."""

    can_alias = False  # the master lives on the host or NVMe, never in the model's buffer
    frees_grads = False  # the host gradient buffers persist (allocated once, pinned)

    def __init__(self, offload):
        self.offload = offload
        self.masters, self.store, self.optimizer = [], None, None
        self._own_state = False  # the optimizer keeps its state itself (Adam8bit/4bit)
        self._restored = {}  # NVMe: key -> fp32 master a checkpoint load fills

    @property
    def pinned(self):
        return self.offload.pin_memory and torch.cuda.is_available()

    @property
    def copies_back_async(self):
        """Whether write_back's values may be copied to the device without waiting: pinned,
        and still there after write_back returns (NVMe's swap buffers are reused at once)."""
        return self.pinned and self.offload.device != "nvme"

    def new_master(self, numel, device, alias=None):
        assert alias is None, "offloaded masters are never the model's buffer"
        master = torch.nn.Parameter(torch.empty(numel, dtype=torch.float32,
                                                pin_memory=self.pinned))
        if self.offload.device == "nvme":  # the values live in the swap files
            master.data.untyped_storage().resize_(0)
        self.masters.append(master)
        return master

    def grad_buffer(self, master):
        return torch.zeros(master.numel(), dtype=torch.float32, pin_memory=self.pinned)

    def finish(self, optimizer):
        """Replace the optimizer by CPUAdam (keeping its param-group dicts, so learning-rate
        schedules still act) and build the state store. Adam8bit/4bit keep their own compact state
        and steps the host masters itself; with "nvme" the store holds only the masters."""
        from zero.optim.quantized_adam import QuantizedAdam
        if isinstance(optimizer, QuantizedAdam):
            self.optimizer, self._own_state = optimizer, True
            if self.offload.device == "nvme":
                self.store = self._swapped(names=("master",))
            return optimizer
        self.optimizer = as_cpu_adam(optimizer)
        self.store = self._resident() if self.offload.device != "nvme" else self._swapped()
        return self.optimizer

    def _resident(self):
        store = ResidentStateStore(self.optimizer, self.offload.sub_group_size)
        for key, master in enumerate(self.masters):
            store.add(key, master)
        return store

    def _swapped(self, names=STATE_NAMES):
        o = self.offload
        swap_dir = swap_dir_for(o.nvme_path, o.stage, "optimizer", o.global_rank)
        numels = [master.numel() for master in self.masters]
        error = None
        try:
            check_nvme_path(o.nvme_path, 4 * len(names) * sum(numels), swap_dir,
                            "zero_optimization.offload_optimizer.nvme_path")
        except ConfigError as e:
            error = e
        agree_on_errors(error)  # before any file is written, on every rank
        fresh_swap_dir(swap_dir)
        store = NvmeStateStore(swap_dir, o.aio, o.sub_group_size, o.buffer_count,
                               o.pipeline_read, o.pipeline_write, o.pin_memory, names)
        # removed by engine.destroy(), else at exit (grad hooks keep the optimizer alive)
        self._remove_swap_files = weakref.finalize(self, _remove_swap_dir, store, swap_dir)
        for key, numel in enumerate(numels):
            store.add(key, numel, fast_init=o.fast_init)
        logger.info("stage %d optimizer %s of %d elements swap to %s", o.stage,
                    "/".join(names), sum(numels), swap_dir)
        return store

    @torch.no_grad()
    def write(self, key, lo, values):
        if self.store is None:  # Adam8bit/4bit in host memory
            self.masters[key].narrow(0, lo, values.numel()).copy_(values.reshape(-1))
            return
        self.store.write_range(key, "master", lo, values)

    def step(self, write_back, grad_divisor=1.0):
        if self._own_state:  # Adam8bit/4bit take no divisor
            divide_grads(self.masters, grad_divisor)
        if self._own_state and self.store is None:
            self.optimizer.step()
            self.publish(write_back)
            return
        if self._own_state:  # Adam8bit/4bit with the masters in swap files: one key at a time
            pending = self.optimizer.begin_step()
            for key, master in enumerate(self.masters):
                empty = master.data  # new_master's: the full shape on a storage of size 0
                master.data = self.store.read(key, "master")
                try:
                    self.optimizer.step_param(master, pending)
                    write_back(key, 0, master.detach())
                    self.store.write_range(key, "master", 0, master.data)
                finally:
                    master.data = empty
            self.optimizer.finish_step(pending)
            return
        # looked up at every step: loading an optimizer state dict replaces the group dicts,
        # and the learning-rate schedule writes to the current ones
        group_of = {id(p): group for group in self.optimizer.param_groups
                    for p in group["params"]}
        grad_scale = torch.tensor(grad_divisor, dtype=torch.float32) \
            if grad_divisor != 1.0 else None
        for key, master in enumerate(self.masters):
            step = self.store.step_tensor(key)
            step += 1
            grad = master.grad
            for sub in self.store.sub_groups(key):
                CPUAdam.update(sub.master, grad[sub.lo:sub.hi], sub.state(step),
                               group_of[id(master)], grad_scale=grad_scale,
                               on_tile=lambda lo, hi, updated, key=key, base=sub.lo:
                               write_back(key, base + lo, updated))

    @torch.no_grad()
    def publish(self, write_back):
        if self._own_state:
            for key in range(len(self.masters)):
                write_back(key, 0, self.read_master(key))
            return
        for key in range(len(self.masters)):
            for sub in self.store.sub_groups(key):
                write_back(key, sub.lo, sub.master)

    # ----- checkpoints (the swapped state as plain tensors) -----

    def read_master(self, key):
        if self.store is None:
            return self.masters[key].detach()
        return self.store.read(key, "master")

    def saved_state(self, key):
        if self.offload.device == "nvme" and not self._own_state:  # swap it in
            return {"exp_avg": self.store.read(key, "exp_avg"),
                    "exp_avg_sq": self.store.read(key, "exp_avg_sq")}
        return saved_state_of(self.optimizer, self.masters[key])

    def state_dict(self):
        saved = self.optimizer.state_dict()
        if self.offload.device == "nvme" and not self._own_state:  # swap the state in
            saved["state"] = {key: {"step": self.store.step_tensor(key).clone(),
                                    "exp_avg": self.store.read(key, "exp_avg"),
                                    "exp_avg_sq": self.store.read(key, "exp_avg_sq")}
                              for key in range(len(self.masters))}
        return saved

    def restore_target(self, key):
        master = self.masters[key]
        if self.offload.device != "nvme":
            return master.data
        if key not in self._restored:  # filled piece by saved piece, then committed
            self._restored[key] = torch.zeros(master.numel(), dtype=torch.float32)
        return self._restored[key]

    def commit(self):
        for key, master in self._restored.items():
            self.store.write_range(key, "master", 0, master)
        self._restored = {}

    def load_state_dict(self, state_dict):
        if self.offload.device != "nvme" or self._own_state:
            self.optimizer.load_state_dict(state_dict)
            return
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for key, state in state_dict["state"].items():
            self.store.step_tensor(key).copy_(state["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                self.store.write_range(key, name, 0, state[name])

    # ----- accounting -----

    def master_bytes(self):
        return sum(m.untyped_storage().nbytes() for m in self.masters)

    def state_bytes(self):
        if self._own_state:  # with nvme, plus one key's fp32 master during the step
            swapped = 4 * max(m.numel() for m in self.masters) if self.store is not None else 0
            return self.optimizer.state_bytes() + swapped
        if self.offload.device == "nvme":
            return self.store.resident_bytes()
        return sum(2 * m.numel() * 4 for m in self.masters)

    def close(self):
        """Delete the swap files (NVMe); the store is unusable afterwards."""
        finalizer = getattr(self, "_remove_swap_files", None)
        if finalizer is not None:
            finalizer()


def _remove_swap_dir(store, swap_dir):
    store.close()
    remove_swap_dir(swap_dir)
