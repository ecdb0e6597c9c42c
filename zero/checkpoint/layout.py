"""DeepSpeed's checkpoint layout (as deepspeed/runtime/engine.py saves it): atomic saves,
re-partitioning loads.

    <save_dir>/latest                                     the tag, rewritten last
    <save_dir>/zero_to_fp32.py                            standalone consolidation script
    <save_dir>/<tag>/mp_rank_{mp:02d}_model_states.pt     DP rank 0 of every TP rank
    <save_dir>/<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   stage 1/2
    <save_dir>/<tag>/layer_{i:02d}-model_{tp:02d}-model_states.pt   pipeline stages' layers

With pipeline stages (DeepSpeed's PipelineEngine), `mp` counts stages and tensor slices
(stage x TP + TP rank), the module's weights go to one file per layer (the module says which:
`layer_state_dicts()` / `load_layer_state_dicts()`, as a PipelineModule does) and the model
states file holds `module: None`.

Files hold plain containers, numbers and tensors only (`torch.load(weights_only=True)` reads
them). The fp32 masters and optimizer states are saved in DeepSpeed's partitioning -- the
flat group padded to a multiple of 2·dp and cut into dp contiguous slices -- so DeepSpeed's own
zero_to_fp32.py can consolidate them. In memory the engine partitions differently (bucket
chunks, zero/stages/stage1_2.py); saving gathers each bucket once to cut out DeepSpeed's slice.
Loading reads, from each saved slice (memory-mapped), only the elements this rank owns, so a
checkpoint loads at any data-parallel size and from any ZeRO stage 0-2. Stage 3 writes its
own files (one model states file per DP rank): zero/checkpoint/stage3.py. How the stage 0-2
optimizer state maps between the two partitionings: zero/checkpoint/partitions.py.

A save writes into `<save_dir>/.<tag>.partial/`; only when every rank has written its files
does rank 0 rename the directory to `<tag>` and then rewrite `latest`, so a crash at any moment
leaves the previous checkpoint and tracker intact.
"""

import functools
import glob
import logging
import os
import re
import shutil
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from zero.checkpoint.partitions import (DS_VERSION, PartitionRestore, check_param_shapes,
                                        zero_optimizer_state)
from zero.checkpoint.files import (all_agree, engine_counters, fsync_dir, layer_states_name,
                                   model_states_name, module_state_on_cpu, on_rank0_then_agree,
                                   optim_files, optim_states_name, report_skipped_keys,
                                   shared_params, stage3_model_states_name, torch_load,
                                   try_)
from zero.checkpoint.whole_params import SavedStage3, load_buffers, saved_stage
from zero.comm.agreement import collective_device
from zero.comm.every_rank import every_rank_calls
from zero.errors import CheckpointError
from zero.fault_injection import kill_point
from zero.fault_injection import writer as fault_writer

logger = logging.getLogger("zero.checkpoint.layout")

MODEL_STATE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "frozen_param_fragments", "shared_params", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "csr_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version"}
ZERO_TO_FP32 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_to_fp32.py")


# ---------------------------------------------------------------------------------------------
# Saving

def save_checkpoint(engine, save_dir, tag, client_state, save_latest):
    every_rank_calls("save_checkpoint")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    _check_tag(tag)
    _check_same_tag_on_every_rank(tag)
    clashes = sorted(MODEL_STATE_KEYS & set(client_state))
    if clashes:
        raise CheckpointError(f"client_state keys {clashes} clash with the checkpoint's own keys; "
                              "rename them")
    _check_plain(client_state, "client_state")
    kill_point("zero.save.start")
    partial_dir = os.path.join(save_dir, f".{tag}.partial")
    on_rank0_then_agree(engine, lambda: _fresh_dir(partial_dir), f"create {partial_dir}")
    kill_point("zero.save.partial_dir_created")
    stage = engine.zero_optimization_stage()
    if stage == 3:  # every DP rank writes model and optim states (zero/checkpoint/stage3.py)
        from zero.checkpoint.stage3 import stage3_files
        writes = stage3_files(engine, client_state)
    else:
        writes = _stage0_2_files(engine, stage, client_state)
    all_agree(engine, try_(lambda: [_durable_save(obj, os.path.join(partial_dir, name))
                                     for name, obj in writes]), f"write into {partial_dir}")
    kill_point("zero.save.files_done")
    on_rank0_then_agree(engine, lambda: _publish(save_dir, partial_dir, tag, save_latest),
                         f"publish {tag} in {save_dir}")
    return True


def _check_same_tag_on_every_rank(tag):
    """Ranks saving under different tags would each write part of a checkpoint into its own
    directory and leave none complete: refused before anything is written (what DeepSpeed's
    checkpoint.tag_validation "Fail" does; its default "Warn" goes on)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    code = zlib.crc32(tag.encode())
    extremes = torch.tensor([code, -code], dtype=torch.int64, device=collective_device())
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if extremes[0].item() != -extremes[1].item():
        raise CheckpointError(f"save_checkpoint: rank {dist.get_rank()} saves under tag "
                              f"'{tag}' and another rank under another tag; every rank must pass "
                              "the same tag (or none: global_step<N>)")


def _stage0_2_files(engine, stage, client_state):
    zero_state = None  # stage 0: one full partition, kept in the model states of DP rank 0
    if stage > 0 or engine.dp_rank == 0:
        zero_state = zero_optimizer_state(engine.optimizer)  # collective over DP in stage 1/2
    writes = []
    if stage > 0:
        name = optim_states_name(engine.dp_rank, engine.checkpoint_rank,
                                 engine.bfloat16_enabled())
        writes.append((name, {"optimizer_state_dict": zero_state,
                              "ds_config": engine.config.raw, "ds_version": DS_VERSION}))
    if engine.dp_rank == 0:
        states = _model_states(engine, zero_state if stage == 0 else None)
        states.update(client_state)
        writes.append((model_states_name(engine.checkpoint_rank), states))
        if _pipelined(engine):
            writes += [(layer_states_name(layer, engine.mp_rank), _on_cpu(state))
                       for layer, state in engine.module.layer_state_dicts().items()]
    return writes


def _pipelined(engine):
    """A pipeline stage: its weights are saved layer by layer."""
    if engine.pp_comm is None:
        return False
    if not hasattr(engine.module, "layer_state_dicts"):
        raise CheckpointError("a pipeline stage's module must provide layer_state_dicts() and "
                              "load_layer_state_dicts() to be checkpointed (DeepSpeed's "
                              "layout saves a pipeline layer by layer)")
    return True


def _on_cpu(state):
    return OrderedDict((k, v.detach().to("cpu", copy=True)) for k, v in state.items())


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.Size,
                 torch.dtype, torch.device)


def _check_plain(value, where):
    """Checkpoints hold what torch.load(weights_only=True) reads: say where anything else is."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set)) and not isinstance(value, torch.Size):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN_LEAVES) or type(value).__module__ == "numpy":
        raise CheckpointError(
            f"{where} is a {type(value).__module__}.{type(value).__name__}; checkpoints hold only "
            "plain containers, numbers, strings and tensors (so torch.load(weights_only=True) "
            "reads them). Convert it first, e.g. vars(args), array.tolist() or "
            "torch.from_numpy(array)")


def _check_tag(tag):
    if not tag or tag.startswith(".") or os.sep in tag or tag in ("latest", "zero_to_fp32.py"):
        raise CheckpointError(f"checkpoint tag {tag!r} is not usable as a directory name; use a "
                              "plain name such as 'global_step100'")


def _durable_save(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, fault_writer(f, "zero.save.file.half_written"))
        kill_point("zero.save.file.written")
        f.flush()
        os.fsync(f.fileno())  # on disk before the directory is renamed into place
    kill_point("zero.save.file.synced")


def _fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def _publish(save_dir, partial_dir, tag, save_latest):
    final_dir = os.path.join(save_dir, tag)
    old_dir = os.path.join(save_dir, f".{tag}.old")
    if os.path.isdir(final_dir):  # re-saving a tag: keep the old one until the new is in place
        shutil.rmtree(old_dir, ignore_errors=True)
        os.replace(final_dir, old_dir)
        kill_point("zero.save.publish.old_moved_aside")
    fsync_dir(partial_dir)  # every rank's files are in it, durably, before it is renamed
    os.replace(partial_dir, final_dir)
    fsync_dir(save_dir)  # the tag is on disk before `latest` may name it
    kill_point("zero.save.publish.renamed")
    shutil.rmtree(old_dir, ignore_errors=True)
    kill_point("zero.save.publish.old_removed")
    _atomic_copy(ZERO_TO_FP32, os.path.join(save_dir, "zero_to_fp32.py"))
    kill_point("zero.save.publish.script_copied")
    if save_latest:
        _atomic_write_text(os.path.join(save_dir, "latest"), tag)
    fsync_dir(save_dir)


def _atomic_write_text(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    kill_point("zero.save.publish.latest_tmp_written")
    os.replace(tmp, path)
    kill_point("zero.save.publish.latest_renamed")


def _atomic_copy(src, dst):
    tmp = f"{dst}.tmp-{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _model_states(engine, optimizer_state):
    module = engine.module
    names = {p: n for n, p in module.named_parameters()}
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    persistent = set(module.state_dict().keys())
    scheduler = engine.lr_scheduler
    return {
        "module": None if _pipelined(engine) else module_state_on_cpu(module),
        "buffer_names": [n for n, _ in module.named_buffers() if n in persistent],
        "optimizer": optimizer_state,
        "param_shapes": [OrderedDict((names[p], p.shape) for p in group.params)
                         for group in engine.optimizer.groups],
        "frozen_param_shapes": OrderedDict((n, p.shape) for n, p in frozen),
        "frozen_param_fragments": {n: p.detach().to("cpu", copy=True) for n, p in frozen},
        "shared_params": shared_params(module),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        **engine_counters(engine),
    }


# ---------------------------------------------------------------------------------------------
# Loading

def load_checkpoint(engine, load_dir, tag, *, module_strict, optimizer_states,
                    lr_scheduler_states, module_only, agree=True):
    """Every rank reads its files (no collectives), then all agree that each succeeded before
    the restored masters reach the model (an all-gather at stages 1-2): a rank that could not
    read its files stops the others with a clear error instead of leaving them waiting.
    Not `agree`: the reading alone; the caller agrees over its whole load and then publishes
    (engine.optimizer.publish_restored_masters), and meets the ranks itself: one that failed
    before its load never calls this."""
    if agree:
        every_rank_calls("load_checkpoint")
    engine.optimizer.forget_restored_masters()  # (those of an earlier load that failed)
    read = functools.partial(_read_checkpoint, engine, load_dir, tag,
                             module_strict=module_strict, optimizer_states=optimizer_states,
                             lr_scheduler_states=lr_scheduler_states, module_only=module_only)
    if not agree:
        return read()
    loaded, error = (None, None), None
    try:
        loaded = read()
    except Exception as e:  # noqa: BLE001 -- re-raised by all_agree, once every rank knows
        error = e
    try:
        all_agree(engine, error, f"load the checkpoint in {load_dir}")
    except Exception:
        engine.optimizer.forget_restored_masters()  # a failed load publishes nothing
        raise
    engine.optimizer.publish_restored_masters()
    return loaded


def _read_checkpoint(engine, load_dir, tag, *, module_strict, optimizer_states,
                     lr_scheduler_states, module_only):
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:  # DeepSpeed's answer: (None, None), the engine as it was
            where = "no 'latest' file in" if os.path.isdir(load_dir) else "no folder"
            logger.warning("%s %s and no tag given: nothing loaded", where, load_dir)
            return None, None
    ckpt_dir = find_tag_dir(load_dir, tag)
    with_state = optimizer_states and not module_only
    if engine.zero_optimization_stage() == 3:  # zero/checkpoint/stage3.py
        from zero.checkpoint.stage3 import load_stage3
        path, states = load_stage3(engine, ckpt_dir, module_strict, with_state)
    elif saved_stage(ckpt_dir, engine.checkpoint_rank) == 3:
        path, states = _load_stage3_layout(engine, ckpt_dir, module_strict, with_state)
    else:
        path, states = _load_stage0_2_layout(engine, ckpt_dir, module_strict, with_state)
    client_state = {k: v for k, v in states.items() if k not in MODEL_STATE_KEYS}
    if module_only:
        return path, client_state
    return _restore_counters(engine, states, lr_scheduler_states, path, client_state)


def _load_stage0_2_layout(engine, ckpt_dir, strict, with_state):
    """The module's weights, then (`with_state`) the masters and optimizer state from the
    saved slices. Returns (path of the model states read, their dict)."""
    path = os.path.join(ckpt_dir, model_states_name(engine.checkpoint_rank))
    states = _load_model_states(path, ckpt_dir, engine.checkpoint_world_size)
    try:
        if _pipelined(engine):
            missing, unexpected = _load_layers(engine, ckpt_dir, strict)
        else:
            missing, unexpected = engine.module.load_state_dict(states["module"], strict=strict)
        report_skipped_keys(missing, unexpected, path)
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not fit the model: {e}") from None
    masters_loaded = with_state and load_zero_optimizer_state(engine, ckpt_dir, states)
    if not masters_loaded:
        engine.optimizer.refresh_masters_from_model()
    return path, states


def _load_stage3_layout(engine, ckpt_dir, strict, with_state):
    """A stage 3 checkpoint at stage 0-2: the masters (and optimizer state) re-partitioned
    parameter by parameter, the buffers and frozen weights from its model states. Returns
    (path of the model states read, their dict): DP rank 0's, as every rank reads at 0-2."""
    if _pipelined(engine):
        raise CheckpointError(f"{ckpt_dir} was saved at ZeRO stage 3, without the pipeline "
                              "stages this run has: resume it without them")
    saved = SavedStage3(ckpt_dir, engine.mp_rank, engine.mp_world_size)
    path = os.path.join(ckpt_dir, stage3_model_states_name(0, engine.mp_rank))
    states = saved.model_states(0)
    module = engine.module
    skipped = load_buffers(module, states, path, strict)
    from zero.checkpoint.restore import restore_optimizer  # (it imports stage3)
    missing = restore_optimizer(engine, saved, with_state, strict)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.requires_grad:
                continue
            if saved.has_frozen(name):
                param.copy_(saved.frozen_full(name, param.numel()).view_as(param))
            elif strict:
                raise CheckpointError(f"{ckpt_dir} has no saved values for frozen parameter "
                                      f"{name} (load_module_strict=False keeps it)")
            else:
                missing.append(name)
    report_skipped_keys(missing, skipped, path)
    return path, states


def _load_layers(engine, ckpt_dir, strict):
    states = {}
    for layer in engine.module.layer_state_dicts():
        path = os.path.join(ckpt_dir, layer_states_name(layer, engine.mp_rank))
        if not os.path.isfile(path):
            raise CheckpointError(f"{ckpt_dir} has no {os.path.basename(path)}: it was saved "
                                  "with other pipeline stages or tensor-parallel size")
        states[layer] = torch_load(path)
    return engine.module.load_layer_state_dicts(states, strict=strict)


def _restore_counters(engine, states, lr_scheduler_states, path, client_state):
    if lr_scheduler_states and engine.lr_scheduler is not None \
            and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    steps = states["global_steps"]
    engine.restore_progress(steps, states.get("global_samples", steps * engine.train_batch_size()),
                            states["skipped_steps"])
    return path, client_state


def read_latest(load_dir):
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest, errors="replace") as f:  # not text: a tag no folder has, said later
        return f.read(1000).strip()


def available_tags(load_dir):
    if not os.path.isdir(load_dir):
        return []
    return sorted(d for d in os.listdir(load_dir) if not d.startswith(".")
                  and glob.glob(os.path.join(load_dir, d, "*_model_states.pt")))


def find_tag_dir(load_dir, tag):
    ckpt_dir = os.path.join(load_dir, str(tag))
    if os.path.isdir(ckpt_dir):
        return ckpt_dir
    interrupted = os.path.join(load_dir, f".{tag}.old")  # a re-save of this tag was cut short
    if os.path.isdir(interrupted):
        logger.warning("using %s: the save that was replacing it did not finish", interrupted)
        return interrupted
    tags = available_tags(load_dir)
    listing = ", ".join(tags) if tags else "none"
    raise CheckpointError(f"checkpoint tag '{tag}' not found in {load_dir}; available tags: "
                          f"{listing}")


def _load_model_states(path, ckpt_dir, mp_world_size):
    if not os.path.isfile(path):
        saved = glob.glob(os.path.join(ckpt_dir, "mp_rank_*_model_states.pt"))
        if saved:
            raise CheckpointError(f"{ckpt_dir} was saved with {len(saved)} tensor-parallel "
                                  f"rank(s) but this run uses {mp_world_size}; missing "
                                  f"{os.path.basename(path)}. Resume with the saved "
                                  "--model-parallel-size or convert the checkpoint first")
        stage3 = {m.group(1) for m in (re.search(r"_mp_rank_(\d+)_model_states", f)
                                         for f in os.listdir(ckpt_dir)) if m}
        if stage3:  # (this rank's own would have been read as stage 3's layout)
            raise CheckpointError(f"{ckpt_dir} was saved at ZeRO stage 3 with {len(stage3)} "
                                  f"tensor-parallel rank(s) but this run uses {mp_world_size};"
                                  f" missing zero_pp_rank_0_{os.path.basename(path)}. Resume with "
                                  "the saved --model-parallel-size or convert the checkpoint "
                                  "first")
        raise CheckpointError(f"{ckpt_dir} holds no model states file ({os.path.basename(path)}); "
                              "it is not a complete zero/DeepSpeed checkpoint")
    states = torch_load(path)
    saved_mp = states.get("mp_world_size", 1)
    if saved_mp != mp_world_size:
        raise CheckpointError(f"{path} was saved with {saved_mp} model-parallel rank(s) "
                              f"(tensor slices x pipeline stages), this run has "
                              f"{mp_world_size}; resume with the saved sizes or convert the "
                              "checkpoint first")
    return states


def load_zero_optimizer_state(engine, ckpt_dir, states):
    """Fill the optimizer from the saved slices; True when fp32 masters were restored."""
    optimizer = engine.optimizer
    if states.get("optimizer") is not None:  # a stage 0 checkpoint: one full "slice"
        sources = [lambda: states["optimizer"]]
    else:
        files = optim_files(ckpt_dir, engine.checkpoint_rank)
        expected = states.get("dp_world_size")
        if not files or len(files) != expected:
            raise CheckpointError(
                f"optimizer states missing in {ckpt_dir}: expected {expected} "
                f"zero_pp_rank_*_mp_rank_{engine.checkpoint_rank:02d}_optim_states.pt file(s), "
                f"found "
                f"{len(files)}. Pass load_optimizer_states=False (pretrain_gpt2.py: "
                "--no-load-optim) to load the weights only")
        sources = [lambda path=path: torch_load(path, mmap=True)["optimizer_state_dict"]
                   for path in files]
    check_param_shapes(engine, states.get("param_shapes"), ckpt_dir)
    # load_from_fp32_weights: false rebuilds the masters from the (16-bit) module weights
    restore = PartitionRestore(optimizer, engine.config.zero_optimization.load_from_fp32_weights)
    for s, load_source in enumerate(sources):
        restore.take(s, load_source(), len(sources))
    return restore.finish()


# ---------------------------------------------------------------------------------------------
# 16-bit model and collective bookkeeping

def save_16bit_model(engine, save_dir, save_filename):
    """Global rank 0 writes module.state_dict() (the model dtype) to save_dir/save_filename."""
    every_rank_calls("save_16bit_model")
    if engine.zero_optimization_stage() == 3:
        from zero.checkpoint.stage3 import save_16bit_model_stage3
        return save_16bit_model_stage3(engine, save_dir, save_filename)
    path = os.path.join(save_dir, save_filename)

    def write():
        os.makedirs(save_dir, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(module_state_on_cpu(engine.module), tmp)
        os.replace(tmp, path)
    on_rank0_then_agree(engine, write, f"save {path}")
    return True


