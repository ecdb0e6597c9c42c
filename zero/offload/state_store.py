"""Where offloaded optimizer state lives: the interface the ZeRO optimizers step through.

An optimizer-state store holds, per key (one flat fp32 partition: a stage 1/2 param group, or
a stage 3 sub-group), the fp32 master weights and Adam's exp_avg / exp_avg_sq, plus the step
count. Optimizers never index it directly; they walk it in sub-groups:

    step = store.step_tensor(key); step += 1
    for sub in store.sub_groups(key):          # SubGroup(lo, hi, master, exp_avg, exp_avg_sq)
        CPUAdam.update(sub.master, grad[sub.lo:sub.hi], sub.state(step), hyperparameters)

- `ResidentStateStore` (offload_optimizer.device "cpu"): the tensors stay in host memory (the
  CPUAdam's own state); sub-groups are views.
- `NvmeStateStore` ("nvme"): the tensors live in three files per key under the swap folder
  (or only the master's, for an optimizer that keeps its own, smaller state in memory).
  Only `buffer_count` sub-groups are in memory at a time; with `pipeline_read` the next
  sub-group is read while this one is stepped, with `pipeline_write` the previous one is
  written back while this one is stepped (DeepSpeed's PipelinedOptimizerSwapper).

Both also offer whole-tensor `read(key, name)` / `write_range(key, name, lo, tensor)` for
checkpoints and initialisation.
"""

import os
from collections import deque
from dataclasses import dataclass

import torch

from zero.offload.aio import AsyncTensorIO
from zero.host_memory import return_freed_buffers_to_os

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class SubGroup:
    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def state(self, step):
        return {"step": step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def sub_group_ranges(numel, sub_group_size):
    return [(lo, min(numel, lo + sub_group_size)) for lo in range(0, numel, sub_group_size)]


class ResidentStateStore:
    """Master and moments in host memory; the moments are `optimizer.state_for(master)`."""

    def __init__(self, optimizer, sub_group_size):
        self.optimizer, self.sub_group_size = optimizer, sub_group_size
        self.masters = {}

    def add(self, key, master):
        self.masters[key] = master

    def step_tensor(self, key):
        return self.optimizer.state_for(self.masters[key])["step"]

    def sub_groups(self, key):
        master = self.masters[key]
        state = self.optimizer.state_for(master)
        for lo, hi in sub_group_ranges(master.numel(), self.sub_group_size):
            yield SubGroup(lo, hi, master.data[lo:hi], state["exp_avg"][lo:hi],
                           state["exp_avg_sq"][lo:hi])

    def read(self, key, name):
        master = self.masters[key]
        return master.detach() if name == "master" else self.optimizer.state_for(master)[name]

    def write_range(self, key, name, lo, tensor):
        self.read(key, name)[lo:lo + tensor.numel()].copy_(tensor)

    def resident_bytes(self):
        return sum(3 * 4 * m.numel() for m in self.masters.values())

    def close(self):
        pass


class NvmeStateStore:
    """Master and moments in files `<swap_dir>/<key>_<name>.tensor.swp`, swapped per sub-group."""

    def __init__(self, swap_dir, aio, sub_group_size, buffer_count=4, pipeline_read=False,
                 pipeline_write=False, pin_memory=False, names=STATE_NAMES):
        self.swap_dir, self.sub_group_size = swap_dir, sub_group_size
        self.names = names  # ("master",): an optimizer that keeps its own state in memory
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self.io = AsyncTensorIO(aio)
        return_freed_buffers_to_os()  # freed swap-ins must not stay resident (host_memory.py)
        self.numels, self.steps = {}, {}
        self._pin = pin_memory and torch.cuda.is_available()
        self._slot_count = max(1, buffer_count)
        self._slots = []  # [3, largest sub-group] fp32 buffers, allocated on first use

    def path(self, key, name):
        return os.path.join(self.swap_dir, f"{key}_{name}.tensor.swp")

    def add(self, key, numel, fast_init=False):
        """Create the files of `key`: zeros for the moments (sparse with fast_init: holes read
        as zeros), and a master that the caller fills with write_range."""
        self.numels[key] = numel
        self.steps[key] = torch.zeros((), dtype=torch.float32)
        for name in self.names:
            with open(self.path(key, name), "wb") as f:
                f.truncate(4 * numel)
        if not fast_init:  # allocate the blocks now, so a full drive fails here, not mid-step
            zeros = torch.zeros(min(numel, self.sub_group_size), dtype=torch.float32)
            for name in set(self.names) & {"exp_avg", "exp_avg_sq"}:
                for lo, hi in sub_group_ranges(numel, self.sub_group_size):
                    self.io.write(zeros[:hi - lo], self.path(key, name), 4 * lo).wait()

    def step_tensor(self, key):
        return self.steps[key]

    # ----- the pipelined walk -----

    def _slot(self, i, length):
        """Buffer `i`, at least `length` long: as long as the largest sub-group this store
        holds, not `sub_group_size` (DeepSpeed's default is 1e9 elements: 12 GB per buffer,
        reserved for a model that may be a thousand times smaller)."""
        while len(self._slots) <= i:
            self._slots.append(None)
        slot = self._slots[i]
        if slot is None or slot.shape[1] < length:
            largest = min(self.sub_group_size, max(self.numels.values()))
            slot = self._slots[i] = torch.empty(3, max(largest, length), dtype=torch.float32,
                                                pin_memory=self._pin)
        return slot

    def sub_groups(self, key):
        """Yield each sub-group swapped in; it is written back when the caller asks for the
        next one (so the caller must be done with it by then). Needs all of STATE_NAMES."""
        assert self.names == STATE_NAMES, "a masters-only store has no sub-groups to walk"
        ranges = sub_group_ranges(self.numels[key], self.sub_group_size)
        free = list(range(self._slot_count))
        writing = deque()  # (pending writes, slot)

        def take_slot():
            if not free:
                pending, slot = writing.popleft()
                _wait_all(pending)
                free.append(slot)
            return free.pop()

        def start_read(i):
            lo, hi = ranges[i]
            slot = take_slot()
            buffer = self._slot(slot, hi - lo)
            views = [buffer[n, :hi - lo] for n in range(3)]
            pending = [self.io.read(v, self.path(key, name), 4 * lo)
                       for v, name in zip(views, STATE_NAMES)]
            return slot, views, pending

        try:
            upcoming = start_read(0) if ranges else None
            for i, (lo, hi) in enumerate(ranges):
                slot, views, pending = upcoming
                _wait_all(pending)
                upcoming = None
                if self.pipeline_read and i + 1 < len(ranges) and (free or writing):
                    upcoming = start_read(i + 1)  # overlaps the caller's step of this one
                yield SubGroup(lo, hi, *views)
                writes = [self.io.write(v, self.path(key, name), 4 * lo)
                          for v, name in zip(views, STATE_NAMES)]
                if self.pipeline_write:
                    writing.append((writes, slot))  # overlaps the next sub-group's step
                else:
                    _wait_all(writes)
                    free.append(slot)
                if upcoming is None and i + 1 < len(ranges):
                    upcoming = start_read(i + 1)
        finally:
            while writing:
                _wait_all(writing.popleft()[0])

    # ----- whole tensors (checkpoints, initialisation) -----

    def read(self, key, name):
        out = torch.empty(self.numels[key], dtype=torch.float32)
        self.io.read(out, self.path(key, name)).wait()
        return out

    def write_range(self, key, name, lo, tensor):
        tensor = tensor.detach().to("cpu", torch.float32).contiguous()
        self.io.write(tensor, self.path(key, name), 4 * lo).wait()

    def resident_bytes(self):
        return sum(s.numel() * 4 for s in self._slots if s is not None)

    def close(self):
        self.io.close()


def _wait_all(pending):
    for p in pending:
        p.wait()
