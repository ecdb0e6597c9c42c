"""`--load` of a Megatron-layout checkpoint saved at other tensor-parallel or pipeline sizes.

Every rank reads all of the checkpoint's files memory-mapped (page cache, not memory of its
own) and, one tensor at a time, merges the full tensor and cuts out only the part its own
tensor-parallel rank and pipeline stage hold (megatron/convert/reshard.py,
pipeline_layout.py); the other stages' tensors are not merged (8-/4-bit Adam moments saved at
several stages are all decoded when the stages are joined). The load then copies that part
into the model and optimizer, and no mapping outlives it. The same conversion as
tools/merge_mp_partitions.py, in memory. The data-parallel size is free in this layout.
"""

from megatron import mpu
from megatron.checkpointing.files import safe_load
from megatron.checkpointing.megatron_lm import as_this_layout
from megatron.checkpointing.megatron_layout import first_rank_checkpoint_name, iteration_to_load
from megatron.convert.checkpoint_files import read_sharded_checkpoint
from megatron.convert.pipeline_layout import stage_file, stage_parameter_names
from megatron.convert.reshard import check_target_stages, checkpoint_of_rank, resharded


def saved_layout(load_dir, step=None):
    """(tensor-parallel size, pipeline stages, layers per virtual stage or None) the
    checkpoint at `load_dir` (of iteration `step`, or the tracker's) was saved at, or None
    without a readable one."""
    iteration, release = iteration_to_load(load_dir, step)
    if iteration is None:
        return None
    path = first_rank_checkpoint_name(load_dir, iteration, release)
    try:
        args = as_this_layout(safe_load(path, mmap=True), path)["args"]
    except Exception:  # noqa: BLE001 -- the load itself reports a missing or damaged file
        return None
    return (args.get("model_parallel_size", 1), args.get("pipeline_model_parallel_size", 1),
            args.get("num_layers_per_virtual_pipeline_stage"))


def convert_for_this_rank(load_dir, step=None, layers_per_virtual_stage=None):
    """(this rank's file contents at the run's layout, a one-line note), or None when the
    checkpoint already has the run's layout (`layers_per_virtual_stage`: the run's
    --num-layers-per-virtual-pipeline-stage)."""
    saved = saved_layout(load_dir, step)
    tp, stages = mpu.get_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
    ours = (tp, stages, layers_per_virtual_stage if stages > 1 else None)
    if saved is None or saved == ours or (saved[:2] == (1, 1) and ours[:2] == (1, 1)):
        return None
    sharded = read_sharded_checkpoint(load_dir, step)
    check_target_stages(sharded.args, stages)
    full, _ = resharded(sharded, tp)  # merges nothing yet: each tensor as it is cut
    stage = mpu.get_pipeline_model_parallel_rank()
    names = stage_parameter_names(list(full.model), full.args, stages, stage, ours[2])
    mine = checkpoint_of_rank(full, tp, mpu.get_model_parallel_rank(), names)
    del full, sharded
    note = (f"--load {load_dir} was saved at {_describe(saved)}; converted to "
            f"{_describe(ours)} as it loaded (weights, optimizer state, schedule)")
    return stage_file(mine, stages, stage, ours[2]), note


def _describe(layout):
    tp, stages, per_virtual = layout
    chunks = f" of {per_virtual}-layer model chunks" if per_virtual else ""
    return f"tensor-parallel size {tp} x {stages} pipeline stage(s){chunks}"
