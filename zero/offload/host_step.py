"""What the offloaded optimizers of stages 1/2 (zero/offload/optimizer.py) and stage 3
(zero/offload/stage3.py) share: CPUAdam over an optimizer-state store, the store's NVMe swap
folder, and the store's side of checkpoints.

The state is kept per key: a stage 1/2 param group's partition, or a stage 3 sub-group. A
class mixing this in provides `offload` (an OptimizerOffload), `optimizer`, and
`_host_masters()`: per key the fp32 master tensor (with device "nvme" its storage is empty
and only its numel counts), then calls `_build_state_store(stage)` once its groups exist.
"""

import logging
import weakref

import torch

from zero.errors import ConfigError
from zero.offload.state_store import NvmeStateStore, ResidentStateStore
from zero.offload.swap_dir import (agree_on_errors, check_nvme_path, fresh_swap_dir,
                                   remove_swap_dir, swap_dir_for)
from zero.ops.cpu_adam import CPUAdam

logger = logging.getLogger("zero.offload")

STATE_BYTES_PER_ELEMENT = 3 * 4  # fp32 master, exp_avg and exp_avg_sq


def as_cpu_adam(optimizer):
    if isinstance(optimizer, CPUAdam):
        return optimizer
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return CPUAdam.from_torch(optimizer)
    raise ConfigError(f"offload_optimizer steps the optimizer with zero.ops.CPUAdam, so the "
                      f"optimizer must be Adam or AdamW (or CPUAdam); got "
                      f"{type(optimizer).__name__}. Remove offload_optimizer to use it")


class HostStepStates:
    """The state store of an offloaded optimizer and its part of save / load."""

    def _build_state_store(self, stage):
        self._restored_masters = {}  # NVMe: key -> fp32 partition a checkpoint load fills
        if self.offload.device != "nvme":
            self.store = ResidentStateStore(self.optimizer, self.offload.sub_group_size)
            for key, master in enumerate(self._host_masters()):
                self.store.add(key, master)
            return
        o = self.offload
        swap_dir = swap_dir_for(o.nvme_path, stage, "optimizer", o.global_rank)
        numels = [master.numel() for master in self._host_masters()]
        needed = STATE_BYTES_PER_ELEMENT * sum(numels)
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
        for key, numel in enumerate(numels):
            store.add(key, numel, fast_init=o.fast_init)
        self.store = store
        self.refresh_masters_from_model()
        logger.info("stage %d optimizer states of %d elements swap to %s", stage, sum(numels),
                    swap_dir)

    def close(self):
        """Delete the swap files (NVMe); the optimizer is unusable afterwards."""
        finalizer = getattr(self, "_remove_swap_files", None)
        if finalizer is not None:
            finalizer()

    # ----- checkpoints (zero/checkpoint/layout.py, zero/checkpoint/stage3.py) -----

    def master_partition(self, key):
        return self.store.read(key, "master")

    def base_state_dict(self):
        saved = self.optimizer.state_dict()
        if self.offload.device == "nvme":  # swap the state in, as plain tensors
            saved["state"] = {key: {"step": self.store.step_tensor(key).clone(),
                                    "exp_avg": self.store.read(key, "exp_avg"),
                                    "exp_avg_sq": self.store.read(key, "exp_avg_sq")}
                              for key in range(len(self._host_masters()))}
        return saved

    def master_restore_target(self, key):
        master = self._host_masters()[key]
        if self.offload.device != "nvme":
            return master.data
        if key not in self._restored_masters:  # filled piece by saved piece, then committed
            self._restored_masters[key] = torch.zeros(master.numel(), dtype=torch.float32)
        return self._restored_masters[key]

    def commit_restored_masters(self):
        for key, master in self._restored_masters.items():
            self.store.write_range(key, "master", 0, master)
        self._restored_masters = {}

    def load_base_state_dict(self, state_dict):
        if self.offload.device != "nvme":
            self.optimizer.load_state_dict(state_dict)
            return
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for key, state in state_dict["state"].items():
            self.store.step_tensor(key).copy_(state["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                self.store.write_range(key, name, 0, state[name])


def _remove_swap_dir(store, swap_dir):
    store.close()
    remove_swap_dir(swap_dir)
