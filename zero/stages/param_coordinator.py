"""ZeRO stage 3: when parameters are gathered and released (DeepSpeed's parameter coordinator).

Forward: a pre-forward hook on every module that owns parameters gathers them (its direct
parameters plus registered external ones), a post-forward hook releases them.

Backward: autograd saves parameters (or views of them, e.g. `weight.t()` inside F.linear) for
the backward pass. A saved-tensor hook stores a reference to the parameter instead of the
tensor, so the full tensor can really be freed after forward; unpacking it in backward
re-gathers the owning module's parameters. A parameter is released again as soon as its
gradient is ready (the stage 3 optimizer calls `release_after_backward`), since nothing in
backward needs a parameter after its gradient is complete. Activation checkpointing works
unchanged: a recomputation inside backward gathers through the same hooks and keeps its
parameters until their gradients are ready.

Trace and prefetch (as DeepSpeed's partitioned_param_coordinator.py does): the first step
records the sequence of fetches (module forwards, then backward re-gathers). From then on, each
fetch also launches the all-gathers of the modules that come next in the trace, up to
`stage3_prefetch_bucket_size` elements and while fewer than `stage3_max_live_parameters`
elements are gathered. A step that departs from the trace stops prefetching and the trace is
recorded again.

Persistent parameters (small ones, below `stage3_param_persistence_threshold`) are gathered
all at once, in one all-gather, by the first fetch after a step; a bias or a LayerNorm weight
costs as much per collective as a weight matrix while its bytes are nothing.

Release policy: a parameter stays gathered if it is persistent (`ds_numel <=
stage3_param_persistence_threshold`, within `stage3_model_persistence_threshold` in total), if
a module still running uses it (nested/external use), if it is in flight from a prefetch, or
if the trace uses it again within `stage3_max_reuse_distance` elements. `step()` releases all.
"""

import bisect
from dataclasses import dataclass

import torch

from zero.offload.param_swapper import read_ahead
from zero.stages.partition_parameters import (ParamStatus, external_parameters, finish_gather,
                                       gather_coalesced, is_zero_param, param_of_storage,
                                       release_param, start_gather)


@dataclass
class Stage3Knobs:
    """The stage3_* keys of zero_optimization (defaults: zero/config/sections.py)."""
    prefetch_bucket_size: int
    max_live_parameters: int
    max_reuse_distance: int
    param_persistence_threshold: int
    model_persistence_threshold: int


class _SavedParam:
    """What autograd keeps instead of a saved parameter (view): enough to rebuild the view."""
    __slots__ = ("param", "size", "stride", "offset")

    def __init__(self, param, tensor):
        self.param, self.size = param, tensor.size()
        self.stride, self.offset = tensor.stride(), tensor.storage_offset()


def _in_backward():
    return torch._C._current_graph_task_id() != -1


class ParamCoordinator:
    def __init__(self, module, knobs):
        self.knobs = knobs
        self.modules = []  # modules that fetch parameters, in registration order
        self.fetches = {}  # module -> its ZeRO params (direct + external)
        self.owner = {}  # param -> module that re-gathers it in backward
        for submodule in module.modules():
            params = [p for p in submodule.parameters(recurse=False) if is_zero_param(p)]
            params += [p for p in external_parameters(submodule)
                       if is_zero_param(p) and all(p is not q for q in params)]
            if not params:
                continue
            self.fetches[submodule] = params
            self.modules.append(submodule)
            for param in params:
                self.owner.setdefault(param, submodule)
        self.index = {m: i for i, m in enumerate(self.modules)}
        self.persistent = self._mark_persistent()
        self._any_swapped = any(getattr(p, "ds_swapper", None) is not None for p in self.owner)
        self._persistent_stale = True  # gather them all at the next fetch
        self._handles = []
        for submodule in self.modules:
            self._handles.append(submodule.register_forward_pre_hook(self._pre_forward))
            self._handles.append(submodule.register_forward_hook(self._post_forward))
        self.live = set()  # gathered or in-flight params fetched through here
        self.live_numel = 0  # their elements (kept as they change: read at every fetch)
        self.trace, self.events = None, []
        self._trace_valid = False
        self._touched_in_backward = set()
        self.fetch_count = 0  # all-gathers issued (prefetches included), for tests/benchmarks

    def _mark_persistent(self):
        """Mark and return (in ds_id order, the same on every rank) the persistent params."""
        budget, persistent = self.knobs.model_persistence_threshold, []
        for param in sorted(self.owner, key=lambda p: p.ds_id):
            if param.ds_numel <= self.knobs.param_persistence_threshold \
                    and param.ds_numel <= budget:
                param.ds_persist = True
                budget -= param.ds_numel
                persistent.append(param)
        return persistent

    def remove_hooks(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ----- fetch -----

    def _pre_forward(self, module, inputs):
        self.fetch(module, forward=True)

    def _post_forward(self, module, inputs, output):
        params = self.fetches[module]
        for param in params:
            param.ds_active_sub_modules = max(0, param.ds_active_sub_modules - 1)
        if _in_backward():
            return  # a recomputation: its parameters are released when their grads are ready
        for param in params:
            self._maybe_release(param)

    def fetch(self, module, forward):
        self._record(module, forward)
        if self._persistent_stale:  # first fetch since the step: all persistent params at once
            self._persistent_stale = False
            self.fetch_count += gather_coalesced(self.persistent)
            for param in self.persistent:
                if param.ds_status is ParamStatus.AVAILABLE:
                    self._start(param)  # (counts it live)
        params = self.fetches[module]
        read_ahead(params)  # NVMe shards: all reads in flight before the first is waited for
        for param in params:
            self._start(param)
        self._prefetch()
        for param in params:
            finish_gather(param)
            if forward:
                param.ds_active_sub_modules += 1

    def _start(self, param):
        if param.ds_status is ParamStatus.NOT_AVAILABLE:
            start_gather(param)
            self.fetch_count += 1
        if param not in self.live:
            self.live.add(param)
            self.live_numel += param.ds_numel

    def _record(self, module, forward):
        event = (self.index[module], forward)
        position = len(self.events)
        self.events.append(event)
        if self._trace_valid and (position >= len(self.trace) or self.trace[position] != event):
            self._trace_valid = False  # this step departs from the trace: stop prefetching

    def _prefetch(self):
        knobs = self.knobs
        if not self._trace_valid or knobs.prefetch_bucket_size == 0:
            return
        budget = min(knobs.prefetch_bucket_size, knobs.max_live_parameters - self.live_numel)
        queued, position, starting = 0, len(self.events), {}
        while queued < budget and position < len(self.trace):
            module = self.modules[self.trace[position][0]]
            for param in self.fetches[module]:
                if param.ds_status is ParamStatus.NOT_AVAILABLE and queued < budget \
                        and param not in starting:
                    starting[param] = None
                    queued += param.ds_numel
            position += 1
        # NVMe shards: read what is gathered now, then read ahead the next bucket, so those
        # reads run on the I/O threads while this module computes (bounded by buffer_count)
        ahead, upcoming = [], 0
        while self._any_swapped and upcoming < knobs.prefetch_bucket_size \
                and position < len(self.trace):
            for param in self.fetches[self.modules[self.trace[position][0]]]:
                if param.ds_status is ParamStatus.NOT_AVAILABLE and param not in starting:
                    ahead.append(param)
                    upcoming += param.ds_numel
            position += 1
        read_ahead(list(starting) + ahead)
        for param in starting:
            self._start(param)

    # ----- saved-tensor hooks (backward re-gathers) -----

    def saved_tensor_hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        param = param_of_storage(tensor)
        if param is None or param.ds_persist:
            return tensor
        return _SavedParam(param, tensor)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        param = saved.param
        module = self.owner.get(param)
        if module is not None and module not in self._touched_in_backward:
            self._touched_in_backward.add(module)
            self.fetch(module, forward=False)
        finish_gather(param)  # (a param no module fetches, e.g. gathered by user code)
        return param.ds_full.as_strided(saved.size, saved.stride, saved.offset)

    # ----- release -----

    def release_after_backward(self, param):
        self._maybe_release(param)

    def _maybe_release(self, param):
        if param.ds_persist or param.ds_active_sub_modules > 0 \
                or param.ds_status is not ParamStatus.AVAILABLE or self._reused_soon(param):
            return
        release_param(param)
        if param in self.live:
            self.live.discard(param)
            self.live_numel -= param.ds_numel

    def _reused_soon(self, param):
        if not self._trace_valid:
            return False
        uses = self._uses.get(param, ())
        position = len(self.events)  # the next event
        i = bisect.bisect_left(uses, position)
        if i == len(uses):
            return False
        distance = self._cumulative[uses[i]] - self._cumulative[position]
        return distance <= self.knobs.max_reuse_distance

    def end_backward(self):
        """After a backward pass: release what backward did not (e.g. frozen params)."""
        self._touched_in_backward.clear()
        for param in list(self.live):
            self._maybe_release(param)

    def end_step(self):
        """After the optimizer step: release everything (partitions changed) and settle the
        trace: the first step's sequence becomes the trace, a departed one is re-recorded."""
        self.release_all()
        if self.trace is None or not self._trace_valid or self.events != self.trace:
            self._set_trace(self.events)
        self.events = []

    def release_all(self):
        for param in list(self.live) + [p for p in self.owner if p.ds_status
                                        is not ParamStatus.NOT_AVAILABLE]:
            release_param(param)
            param.ds_active_sub_modules = 0
        self.live.clear()
        self.live_numel = 0
        self._touched_in_backward.clear()
        self._persistent_stale = True

    def _set_trace(self, events):
        self.trace = list(events)
        self._trace_valid = bool(self.trace)
        self._uses, self._cumulative = {}, [0]
        for position, (m, _) in enumerate(self.trace):
            module = self.modules[m]
            for param in self.fetches[module]:
                self._uses.setdefault(param, []).append(position)
            self._cumulative.append(self._cumulative[-1]
                                    + sum(p.ds_numel for p in self.fetches[module]))
