"""ZeRO-Infinity parameter offload: stage 3 parameter shards in NVMe swap files (what
DeepSpeed's partitioned_param_swapper.py does).

    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme",
                                                         "buffer_count": 5, "max_in_cpu": 0}}

A swapped parameter keeps `param.ds_tensor` as a storage-less tensor (its numel, dtype and
device are right, it holds no bytes); its values live in
`<nvme_path>/zero_stage_3/<dtype>params/rank<R>/<ds_id>_param.tensor.swp` (DeepSpeed's names).
The shard is read before the parameter's all-gather (`swap_in`) and the read buffer is dropped
as soon as the all-gather is done, so between gathers a rank holds no parameter bytes at all.
The stage 3 coordinator calls `read_ahead` along its recorded trace, so the reads of the next
modules' shards run on the I/O threads while this module computes.

How each `offload_param` key acts:
- buffer_count: at most this many shards are read ahead (held in memory before their gather).
- buffer_size: shards of more elements than this stay in host memory (as DeepSpeed's buffer
  pool cannot stage them), within `max_in_cpu`.
- max_in_cpu: elements of such host-resident shards allowed; more is a ConfigError.
- pin_memory: read buffers are pinned (page-locked) where CUDA exists.
"""

import os
import weakref

import torch

from zero.errors import ConfigError
from zero.offload.aio import AsyncTensorIO
from zero.host_memory import return_freed_buffers_to_os
from zero.offload.swap_dir import check_nvme_path, fresh_swap_dir, remove_empty_folders

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_SWAPPERS = {}  # (nvme_path, rank) -> ParamSwapper: one per folder, shared by all models


def storage_less(numel, dtype, device="cpu"):
    """A tensor that reports `numel` elements of `dtype` but owns no memory."""
    placeholder = torch.empty(numel, dtype=dtype, device=device)
    placeholder.untyped_storage().resize_(0)
    return placeholder


def is_swapped(param):
    return getattr(param, "ds_swap_path", None) is not None


class ParamSwapper:
    """Writes shards out at partition time, reads them back (ahead) for gathers."""

    @classmethod
    def for_path(cls, nvme_path, aio, global_rank, buffer_count=5, buffer_size=100_000_000,
                 max_in_cpu=1_000_000_000, pin_memory=False):
        """The swapper of (nvme_path, rank); the folder is checked and wiped when first used."""
        key = (os.path.abspath(nvme_path), global_rank)
        swapper = _SWAPPERS.get(key)
        if swapper is None or swapper.closed:
            swapper = cls(nvme_path, aio, global_rank)
            _SWAPPERS[key] = swapper
        swapper.configure(buffer_count, buffer_size, max_in_cpu, pin_memory)
        return swapper

    def __init__(self, nvme_path, aio, global_rank):
        self.root = os.path.join(nvme_path, "zero_stage_3")
        self.rank = global_rank
        check_nvme_path(nvme_path, 0, self.root, "zero_optimization.offload_param.nvme_path")
        self.io = AsyncTensorIO(aio)
        return_freed_buffers_to_os()  # else freed shards and layers stay resident
        self._fresh = set()  # dtype folders wiped by this process
        self._reads = {}  # param -> (buffer, PendingIO): read ahead, not yet swapped in
        self.in_cpu = 0  # elements of shards kept in host memory (too large for a buffer)
        self.closed = False

    def configure(self, buffer_count, buffer_size, max_in_cpu, pin_memory):
        self.buffer_count, self.buffer_size = max(1, int(buffer_count)), int(buffer_size)
        self.max_in_cpu = int(max_in_cpu)
        self.pin = bool(pin_memory) and torch.cuda.is_available()

    def folder(self, dtype):
        path = os.path.join(self.root, f"{DTYPE_NAMES.get(dtype, str(dtype))}params",
                            f"rank{self.rank}")
        if path not in self._fresh:  # files of an earlier run are stale
            fresh_swap_dir(path)
            self._fresh.add(path)
        return path

    # ----- partition time -----

    def offload(self, param, shard):
        """Put `shard` (this rank's values of `param`) in its swap file; returns what
        `param.ds_tensor` becomes: a storage-less tensor, or `shard` itself if it stays in
        host memory."""
        numel = shard.numel()
        if numel > self.buffer_size:
            if self.in_cpu + numel > self.max_in_cpu:
                raise ConfigError(
                    f"offload_param: a parameter shard of {numel} elements is larger than "
                    f"buffer_size ({self.buffer_size}) so it must stay in host memory, but "
                    f"max_in_cpu ({self.max_in_cpu}) is used up; raise buffer_size above "
                    f"{numel} or max_in_cpu")
            self.in_cpu += numel
            param.ds_swap_path = None
            return shard
        path = os.path.join(self.folder(shard.dtype), f"{param.ds_id}_param.tensor.swp")
        param.ds_swap_path = path
        self._write_sync(path, shard.contiguous())
        weakref.finalize(param, _remove_quietly, path)
        return storage_less(numel, shard.dtype, shard.device)

    def _write_sync(self, path, tensor, element_offset=0):
        try:
            self.io.write(tensor, path, element_offset * tensor.element_size()).wait()
        except OSError as e:
            raise ConfigError(f"offload_param: writing {path} failed ({e.strerror}); free space "
                              "on the nvme_path drive or choose another nvme_path") from None

    # ----- gather time -----

    def read_ahead(self, params):
        """Start the reads of swapped shards (at most buffer_count held ahead)."""
        for param in params:
            if len(self._reads) >= self.buffer_count:
                return
            if is_swapped(param) and param not in self._reads:
                self._reads[param] = self._start_read(param)

    def _start_read(self, param):
        shard = param.ds_tensor
        buffer = torch.empty(shard.numel(), dtype=shard.dtype, pin_memory=self.pin)
        return buffer, self.io.read(buffer, param.ds_swap_path)

    def swap_in(self, param):
        """This rank's shard of `param` in memory (waits for its read)."""
        buffer, pending = self._reads.pop(param, None) or self._start_read(param)
        pending.wait()
        return buffer

    def write(self, param, values, element_offset=0):
        """Asynchronously write `values` at `element_offset` of param's shard (PendingIO)."""
        stale = self._reads.pop(param, None)  # read ahead before this update: drop it
        if stale is not None:
            stale[1].wait()
        # a copy: the caller's buffer (a swapped-in sub-group) is reused before the write ends
        values = values.detach().to("cpu", param.ds_tensor.dtype, copy=True).contiguous()
        return self.io.write(values, param.ds_swap_path, element_offset * values.element_size())

    def forget(self, params):
        """Delete the files of `params` (engine.destroy)."""
        for param in params:
            self._reads.pop(param, None)
            if is_swapped(param):
                _remove_quietly(param.ds_swap_path)
                folder = os.path.dirname(param.ds_swap_path)
                if not os.path.isdir(folder):  # removed with its last file: create it again
                    self._fresh.discard(folder)

    def resident_bytes(self):
        return sum(b.numel() * b.element_size() for b, _ in self._reads.values())


def swapper_of(param):
    return getattr(param, "ds_swapper", None) if is_swapped(param) else None


def read_ahead(params):
    """Start the NVMe reads of those of `params` that are swapped (grouped by swapper)."""
    by_swapper = {}
    for param in params:
        swapper = swapper_of(param)
        if swapper is not None:
            by_swapper.setdefault(swapper, []).append(param)
    for swapper, mine in by_swapper.items():
        swapper.read_ahead(mine)


def read_shard(param):
    """The shard of `param` as a tensor in memory (swapped in if needed)."""
    swapper = swapper_of(param)
    return swapper.swap_in(param) if swapper is not None else param.ds_tensor


def write_shard(param, values):
    """Replace the shard of `param` by `values` (in memory or in its swap file)."""
    swapper = swapper_of(param)
    if swapper is None:
        with torch.no_grad():
            param.ds_tensor.copy_(values)
    else:
        swapper.write(param, values).wait()


def _remove_quietly(path):
    """Delete a shard's swap file (engine.destroy, or the parameter's finalizer at exit), then
    rank<R>, <dtype>params and zero_stage_3 above it once they are empty."""
    try:
        os.remove(path)
    except OSError:
        pass
    remove_empty_folders(os.path.dirname(path), 3)
