"""A ZeRO checkpoint read one whole parameter at a time, whichever stage saved it.

Stage 0-2 files keep each optimizer param group as one flat tensor cut into dp contiguous
slices (zero/checkpoint/partitions.py); stage 3 files keep every parameter cut into dp pieces
at the same offset of each rank's flat sub-groups (zero/checkpoint/stage3.py). Both readers
here answer the same questions -- a parameter's fp32 master, each per-element optimizer state,
the scalar state and hyperparameters of its param group, its runs of quantised scales -- from
memory-mapped files, touching only that parameter's elements (zero/checkpoint/per_parameter.py's
PerParameterReader answers them for the Megatron layout's per-parameter optimizer state).
zero/checkpoint/restore.py cuts this rank's partition out of any reader, at any stage: a checkpoint
resumes at any data-parallel size and at the other family of stages (3 <-> 0-2), fp32
masters and optimizer state included, which DeepSpeed does only through its
universal-checkpoint conversion (ds_to_universal.py).
"""

import os

import torch

from zero.checkpoint import files as common
from zero.checkpoint.files import stage3_model_states_name
from zero.checkpoint.partitions import natural_partition_numel
from zero.checkpoint.zero_to_fp32 import loss_scaler_state
from zero.errors import CheckpointError
from zero.optim.quantized_state import TABLE as QUANTIZED_TABLE
from zero.optim.quantized_state import merge_tables, rename_table, split_table


def _zero_file(path):
    return common.torch_load(path, mmap=True)


def saved_stage(ckpt_dir, mp_rank):
    """3 or "0-2" by the model states files in `ckpt_dir` (None: neither)."""
    if os.path.isfile(os.path.join(ckpt_dir, stage3_model_states_name(0, mp_rank))):
        return 3
    if os.path.isfile(os.path.join(ckpt_dir, common.model_states_name(mp_rank))):
        return "0-2"
    return None


def open_saved(ckpt_dir, mp_rank, mp_world_size, dp_rank=0, load=None):
    """The reader for the layout `ckpt_dir` holds, for model-parallel rank `mp_rank` of
    `mp_world_size` (the size the checkpoint must have been saved at). `dp_rank`: whose
    model states `path` names (stage 3 writes one per data-parallel rank). `load(path)`
    reads a file (default: zero's own files only, memory-mapped; a converter of checkpoints
    DeepSpeed wrote passes zero_to_fp32.load_zero_file)."""
    reader = SavedStage0_2 if saved_stage(ckpt_dir, mp_rank) == "0-2" else SavedStage3
    return reader(ckpt_dir, mp_rank, mp_world_size, dp_rank, load)


def check_param_groups(saved, names_per_group):
    """Each parameter must sit in the optimizer param group it was saved in (its weight decay
    and state belong to that group); a parameter the checkpoint lacks is the loader's to
    judge."""
    if len(saved.param_groups) != len(names_per_group):
        raise CheckpointError(f"the checkpoint has {len(saved.param_groups)} optimizer param "
                              f"groups, the optimizer {len(names_per_group)}")
    moved = [(name, saved.group_of(name), g) for g, names in enumerate(names_per_group)
             for name in names if saved.has(name) and saved.group_of(name) != g]
    if moved:
        name, was, now = moved[0]
        raise CheckpointError(f"{len(moved)} parameter(s) of {saved.ckpt_dir} sit in another "
                              f"optimizer param group than when saved ({name}: group {was}, "
                              f"now {now}); pass load_optimizer_states=False "
                              "(pretrain_gpt2.py: --no-load-optim) to load the weights only")


def load_buffers(module, states, path, strict):
    """Returns the saved buffers the module does not have (an error when `strict`)."""
    saved = states.get("module", {})
    own = dict(module.named_buffers())
    skipped = []
    for name in states.get("buffer_names", []):
        if name not in saved:
            raise CheckpointError(f"{path} lacks buffer {name}")
        if name not in own:
            if strict:
                raise CheckpointError(f"{path} has buffer {name}, which the model lacks "
                                      "(load_module_strict=False skips it)")
            skipped.append(name)
            continue
        with torch.no_grad():
            own[name].copy_(saved[name])
    return skipped


def _per_element(value, numel):
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def _check_mp_size(states, path, mp_world_size):
    saved_mp = states.get("mp_world_size", 1)
    if saved_mp != mp_world_size:
        raise CheckpointError(f"{path} was saved with tensor-parallel size {saved_mp}, this "
                              f"run uses {mp_world_size}; resume with the saved size or "
                              "convert the checkpoint first")


class SavedStage3:
    """A stage 3 checkpoint's files, memory-mapped, and where each parameter's pieces are."""

    pipelined = False  # (stage 3 runs no pipeline stages)

    def __init__(self, ckpt_dir, mp_rank, mp_world_size, dp_rank=0, load=None):
        self.ckpt_dir, self.mp_rank, self._load = ckpt_dir, mp_rank, load or _zero_file
        self.path = os.path.join(ckpt_dir, stage3_model_states_name(dp_rank, mp_rank))
        first = os.path.join(ckpt_dir, stage3_model_states_name(0, mp_rank))
        if not os.path.isfile(first):
            raise CheckpointError(f"{ckpt_dir} holds no ZeRO model states "
                                  f"({os.path.basename(first)} or "
                                  f"{common.model_states_name(mp_rank)})")
        self.states0 = self._load(first)
        _check_mp_size(self.states0, first, mp_world_size)
        self.world = self.states0["dp_world_size"]
        files = common.optim_files(ckpt_dir, mp_rank)
        if len(files) != self.world:
            raise CheckpointError(f"optimizer states missing in {ckpt_dir}: expected "
                                  f"{self.world} zero_pp_rank_*_mp_rank_{mp_rank:02d}_"
                                  f"optim_states.pt file(s), found {len(files)}")
        self.optim = [self._load(f)["optimizer_state_dict"] for f in files]
        first_optim = self.optim[0]
        if first_optim.get("zero_stage") != 3:
            raise CheckpointError(f"{ckpt_dir} mixes ZeRO stage 3 model states with stage "
                                  f"{first_optim.get('zero_stage')} optimizer states")
        self.flats = [o["fp32_flat_groups"] for o in self.optim]
        self.states = [o["optimizer_state_dict"]["state"] for o in self.optim]
        self.param_groups = first_optim["optimizer_state_dict"]["param_groups"]
        self.loss_scaler = loss_scaler_state(first_optim.get("loss_scaler"))
        self.where = {}  # name -> (sub-group, offset, piece size)
        for g, shapes in enumerate(self.states0["param_shapes"]):
            offset = 0
            for name, shape in shapes.items():
                size = -(-torch.Size(shape).numel() // self.world)
                self.where[name] = (g, offset, size)
                offset += size
        self._group_of_sub_group = {sub: g for g, group in enumerate(self.param_groups)
                                    for sub in group["params"]}
        table = merge_tables([s.get(QUANTIZED_TABLE) for state in self.states
                              for s in state.values()])
        self._tables = split_table(table) if table is not None else None

    def model_states(self, dp_rank):
        """The model states a rank takes its buffers, counters and client state from: its own
        file, or rank 0's at a larger DP size than saved (the shared parts agree)."""
        own = os.path.join(self.ckpt_dir, stage3_model_states_name(dp_rank, self.mp_rank))
        if dp_rank < self.world and os.path.isfile(own):
            return self._load(own)
        return dict(self.states0)

    def names(self):
        """The saved parameters' names, group by group."""
        return list(self.where)

    def has(self, name):
        return name in self.where

    def group_of(self, name):
        """The index of the optimizer param group `name` was saved in."""
        return self._group_of_sub_group[self.where[name][0]]

    def _full(self, name, numel, tensors_of_rank):
        g, offset, size = self.where[name]
        pieces = [tensors_of_rank(r)[g].narrow(0, offset, size) for r in range(self.world)]
        return torch.cat(pieces)[:numel]

    def master(self, name, numel):
        return self._full(name, numel, lambda r: self.flats[r])

    def per_element_keys(self, name):
        """{key: dtype} of the per-element optimizer states saved for `name`."""
        g = self.where[name][0]
        numel = self.flats[0][g].numel()
        return {key: value.dtype for key, value in self.states[0].get(g, {}).items()
                if _per_element(value, numel)}

    def state(self, name, key, numel):
        return self._full(name, numel, lambda r: {g: s[key] for g, s in self.states[r].items()})

    def scalar_state(self, name):
        """The state of `name`'s group that is not per element (Adam's step)."""
        g = self.where[name][0]
        numel = self.flats[0][g].numel()
        return {key: value for key, value in self.states[0].get(g, {}).items()
                if key != QUANTIZED_TABLE and not _per_element(value, numel)}

    def table(self, name, key):
        """`name`'s runs of quantised scales named `key`; None when the state is not
        quantised, an empty table when this parameter has no runs."""
        if self._tables is None:
            return None
        code = next(iter(self._tables.values()))["code"] if self._tables else "8-bit"
        return rename_table(self._tables.get(name, {"code": code, "scales": [], "small": []}), key)

    def has_frozen(self, name):
        return name in (self.states0.get("frozen_param_fragments") or {})

    def frozen_full(self, name, numel):
        pieces = [self._load(os.path.join(self.ckpt_dir, stage3_model_states_name(
            r, self.mp_rank)))["frozen_param_fragments"][name].reshape(-1)
            for r in range(self.world)]
        return torch.cat(pieces)[:numel]


class SavedStage0_2:
    """A stage 0-2 checkpoint's files, memory-mapped: every param group's flat tensor, cut
    into the saved ranks' contiguous slices (the elements [s·size, (s+1)·size) in slice s)."""

    def __init__(self, ckpt_dir, mp_rank, mp_world_size, dp_rank=0, load=None):
        del dp_rank  # one model states file for all data-parallel ranks
        self.ckpt_dir, self._load = ckpt_dir, load or _zero_file
        self.path = os.path.join(ckpt_dir, common.model_states_name(mp_rank))
        self.states0 = self._load(self.path)
        _check_mp_size(self.states0, self.path, mp_world_size)
        # with pipeline stages the weights are in layer files (layer_*-model_states.pt)
        self.pipelined = self.states0.get("module") is None
        if self.states0.get("optimizer") is not None:  # stage 0: one full slice
            self.slices = [self.states0["optimizer"]]
        else:
            files = common.optim_files(ckpt_dir, mp_rank)
            if not files or len(files) != self.states0.get("dp_world_size"):
                raise CheckpointError(
                    f"optimizer states missing in {ckpt_dir}: expected "
                    f"{self.states0.get('dp_world_size')} zero_pp_rank_*_mp_rank_"
                    f"{mp_rank:02d}_optim_states.pt file(s), found {len(files)}")
            self.slices = [self._load(f)["optimizer_state_dict"] for f in files]
        first = self.slices[0]
        if not isinstance(first.get("base_optimizer_state"), dict):
            raise CheckpointError(
                f"{ckpt_dir}: its optimizer state is in DeepSpeed's elastic form (a list per "
                "group, the default before DeepSpeed 0.5.7), which is not read; load the "
                "weights only")
        self.param_groups = first["base_optimizer_state"]["param_groups"]
        self.loss_scaler = loss_scaler_state(first.get("loss_scaler"))
        self.has_fp32 = "single_partition_of_fp32_groups" in first
        self.where = {}  # name -> (group, offset in the flat group, numel, index in the group)
        self.group_numels = []
        for g, shapes in enumerate(self.states0["param_shapes"]):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                numel = torch.Size(shape).numel()
                self.where[name] = (g, offset, numel, i)
                offset += numel
            self.group_numels.append(offset)
        self._tables = {}
        for g in range(len(self.group_numels)):
            table = merge_tables([s["base_optimizer_state"]["state"].get(g, {}).get(
                QUANTIZED_TABLE) for s in self.slices])
            if table is not None:
                self._tables[g] = split_table(table)

    def model_states(self, dp_rank):
        del dp_rank  # one model states file for all data-parallel ranks
        return dict(self.states0)

    def names(self):
        """The saved parameters' names, group by group."""
        return list(self.where)

    def has(self, name):
        return name in self.where

    def group_of(self, name):
        return self.where[name][0]

    def _slice_size(self, g):
        return natural_partition_numel(self.group_numels[g],
                                       self.slices[0]["partition_count"][g])

    def _range(self, name, tensor_of_slice):
        """`name`'s elements, read from the slices that hold them."""
        g, lo, numel, _ = self.where[name]
        size, hi = self._slice_size(g), lo + numel
        pieces = []
        for s in range(lo // size, -(-hi // size)):
            a, b = max(lo, s * size), min(hi, (s + 1) * size)
            pieces.append(tensor_of_slice(self.slices[s], g).narrow(0, a - s * size, b - a))
        return torch.cat(pieces)

    def master(self, name, numel):
        if self.has_fp32:
            return self._range(name, lambda s, g: s["single_partition_of_fp32_groups"][g])
        # an fp32 stage 0 checkpoint keeps its masters as the module's weights
        return self.states0["module"][name].float().reshape(-1)

    def _group_state(self, name):
        return self.slices[0]["base_optimizer_state"]["state"].get(self.where[name][0], {})

    def per_element_keys(self, name):
        size = self._slice_size(self.where[name][0])
        return {key: value.dtype for key, value in self._group_state(name).items()
                if _per_element(value, size)}

    def state(self, name, key, numel):
        return self._range(name, lambda s, g: s["base_optimizer_state"]["state"][g][key])

    def scalar_state(self, name):
        size = self._slice_size(self.where[name][0])
        return {key: value for key, value in self._group_state(name).items()
                if key != QUANTIZED_TABLE and not _per_element(value, size)}

    def table(self, name, key):
        g, _, _, i = self.where[name]
        if g not in self._tables:
            return None
        code = self.slices[0]["base_optimizer_state"]["state"][g][QUANTIZED_TABLE]["code"]
        # stage 0-2 names a parameter's runs (group, index in the group)
        parts = self._tables[g]
        own = next((part for saved_key, part in parts.items()
                    if tuple(saved_key) == (g, i)), None)
        return rename_table(own or {"code": code, "scales": [], "small": []}, key)

    def has_frozen(self, name):
        return name in (self.states0.get("frozen_param_fragments") or {})

    def frozen_full(self, name, numel):
        return self.states0["frozen_param_fragments"][name].reshape(-1)[:numel]
