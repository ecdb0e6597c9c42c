"""Read every tensor-parallel shard of a Megatron-layout checkpoint, and write a new set.

    <dir>/latest_checkpointed_iteration.txt      "200" or "release"
    <dir>/iter_0000200/mp_rank_{00..N-1}/model_optim_rng.pt
    <dir>/iter_0000200/mp_rank_{00..N-1}_{000..P-1}/model_optim_rng.pt   with pipeline stages
"""

import glob
import os
import re
import shlex
import socket
import shutil
from dataclasses import dataclass
from typing import List

from megatron.checkpointing.files import atomic_torch_save, atomic_write_text, safe_load
from megatron.checkpointing.megatron_lm import as_this_layout
from megatron.checkpointing.megatron_layout import (TRACKER_FILENAME, get_checkpoint_name,
                                                    read_tracker)
from megatron.checkpointing.retention import run_id_path
from megatron.config.from_checkpoint import tokenizer_files_beside
from megatron.convert.pipeline_layout import join_stages, split_stages
from megatron.errors import CheckpointError

_RANK_DIR = re.compile(r"mp_rank_(\d{2})")
_STAGE_DIR = re.compile(r"mp_rank_\d{2}_(\d{3})")


@dataclass
class ShardedCheckpoint:
    """One iteration of a checkpoint: the loaded file of each tensor-parallel rank (a
    checkpoint with pipeline stages has its stages joined: megatron/convert/pipeline_layout)."""
    load_dir: str
    iteration: int
    release: bool
    shards: List[dict]  # model_optim_rng.pt contents, indexed by tensor-parallel rank
    pipeline_model_parallel_size: int = 1  # as saved

    def __post_init__(self):
        args = self.shards[0].get("args") if self.shards else None
        if isinstance(args, dict):  # a converted folder, moved: its tokenizer is beside it
            args.update(tokenizer_files_beside(args, self.load_dir))

    @property
    def args(self):
        return self.shards[0]["args"]

    @property
    def model_parallel_size(self):
        return len(self.shards)


def read_sharded_checkpoint(load_dir, iteration=None):
    """Load all shards of `iteration` (default: the one the tracker names)."""
    iteration, release = _resolve_iteration(load_dir, iteration)
    directory = os.path.dirname(os.path.dirname(
        get_checkpoint_name(load_dir, iteration, mp_rank=0, release=release)))
    if not os.path.isdir(directory):
        if os.path.isfile(os.path.join(load_dir, "latest")):
            raise CheckpointError(f"{load_dir} holds a DeepSpeed checkpoint (its 'latest' file "
                                  "names a global_step folder): read it as one, with "
                                  "--deepspeed (convert_checkpoint.py: --loader deepspeed)")
        raise CheckpointError(f"{os.path.join(load_dir, TRACKER_FILENAME)} names iteration "
                              f"{'release' if release else iteration}, but {directory} does "
                              "not exist; the tracker file does not match the folders")
    stages = _stage_folders(directory)
    if stages:
        return _read_staged(load_dir, iteration, release, directory, max(stages) + 1)
    first_path = get_checkpoint_name(load_dir, iteration, mp_rank=0, release=release,
                                     pipeline_parallel=False)
    first = _read_file(first_path)
    if not isinstance(first, dict) or not isinstance(first.get("args"), dict) \
            or "model" not in first:
        raise CheckpointError(f"{first_path} has no 'model' and 'args' entries: it was not "
                              "saved by pretrain_gpt2.py and cannot be converted")
    size = first["args"].get("model_parallel_size", 1)
    _check_rank_dirs(directory, size)
    shards = [first]
    for rank in range(1, size):
        path = get_checkpoint_name(load_dir, iteration, mp_rank=rank, release=release,
                                   pipeline_parallel=False)
        shard = _read_file(path)
        saved_size = shard.get("args", {}).get("model_parallel_size")
        if saved_size != size or shard.get("iteration") != first.get("iteration"):
            raise CheckpointError(
                f"{path} (model_parallel_size {saved_size}, iteration "
                f"{shard.get('iteration')}) does not belong with {first_path} "
                f"(model_parallel_size {size}, iteration {first.get('iteration')}); the "
                "directory mixes two checkpoints")
        shards.append(shard)
    return ShardedCheckpoint(load_dir, iteration, release, shards)


def _read_file(path):
    """One model_optim_rng.pt, memory-mapped, in this trainer's layout (Megatron-LM's own
    files renamed: megatron/checkpointing/megatron_lm.py)."""
    return as_this_layout(safe_load(path, mmap=True), path)


def _stage_folders(directory):
    """The pipeline stages whose mp_rank_TT_PPP folders `directory` holds; none for a
    checkpoint saved without stages. (One stage's folder alone is still a staged checkpoint,
    whose first file says how many stages it should have.)"""
    return {int(m.group(1)) for m in map(_STAGE_DIR.fullmatch, os.listdir(directory)) if m}


def _read_staged(load_dir, iteration, release, directory, stages):
    """Every mp_rank_TT_PPP file, each tensor-parallel rank's stages joined into one."""
    first_path = get_checkpoint_name(load_dir, iteration, 0, release, pp_rank=0,
                                     pipeline_parallel=True)
    first = _read_file(first_path)
    if not isinstance(first, dict) or not isinstance(first.get("args"), dict):
        raise CheckpointError(f"{first_path} has no 'args' entry: it was not saved by "
                              "pretrain_gpt2.py and cannot be converted")
    size = first["args"].get("model_parallel_size", 1)
    saved_stages = first["args"].get("pipeline_model_parallel_size", stages)
    expected = [f"mp_rank_{t:02d}_{s:03d}" for t in range(size) for s in range(saved_stages)]
    present = sorted(d for d in os.listdir(directory)
                     if _STAGE_DIR.fullmatch(d) or _RANK_DIR.fullmatch(d))
    missing = [d for d in expected
               if not os.path.isfile(os.path.join(directory, d, "model_optim_rng.pt"))]
    if missing or present != expected:
        raise CheckpointError(
            f"{directory} should hold {', '.join(expected)} (model_parallel_size {size} x "
            f"pipeline_model_parallel_size {saved_stages}), but holds {', '.join(present)}: "
            "the checkpoint is incomplete or mixes two saves")
    shards = []
    for rank in range(size):
        files = [first if rank == 0 and stage == 0 else
                 _read_file(get_checkpoint_name(load_dir, iteration, rank, release,
                                                pp_rank=stage, pipeline_parallel=True))
                 for stage in range(saved_stages)]
        for stage, contents in enumerate(files):
            if contents.get("iteration") != first.get("iteration"):
                raise CheckpointError(f"{directory}: mp_rank_{rank:02d}_{stage:03d} is of "
                                      f"iteration {contents.get('iteration')}, mp_rank_00_000 "
                                      f"of {first.get('iteration')}; the folder mixes two saves")
        shards.append(join_stages(files))
    return ShardedCheckpoint(load_dir, iteration, release, shards, saved_stages)


def inside_a_checkpoint(path):
    """When `path` is a folder inside a checkpoint (a Megatron iteration or rank folder, a
    DeepSpeed step folder): the sentence that names the checkpoint folder to give instead;
    else None."""
    path = os.path.abspath(path)
    name, parent = os.path.basename(path), os.path.dirname(path)
    if re.fullmatch(r"iter_\d{7}|release", name):
        what, folder = "an iteration folder of a Megatron-layout checkpoint", parent
    elif re.fullmatch(r"mp_rank_\d{2}(_\d{3})?", name):
        what, folder = "a rank folder of a Megatron-layout checkpoint", os.path.dirname(parent)
    elif re.fullmatch(r"global_step\d+", name) or glob.glob(os.path.join(path,
                                                                          "*_model_states.pt")):
        what, folder = "a step folder of a DeepSpeed checkpoint", parent
    else:
        return None
    return (f"{path} is {what}: give the checkpoint folder above it, {folder} (its tracker "
            f"names the step to read; {_ANOTHER_ITERATION} reads another)")


# how each entry point reads an iteration other than the tracker's
_ANOTHER_ITERATION = ("--iteration N (merge_mp_partitions.py, convert_checkpoint.py) or "
                      "--ckpt-step N (the trainer, generation, evaluation)")


def _resolve_iteration(load_dir, iteration):
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"the checkpoint folder {load_dir} is not a directory")
    if iteration is not None:
        directory = os.path.join(load_dir, f"iter_{iteration:07d}")
        if not os.path.isdir(directory):
            found = sorted(d for d in os.listdir(load_dir) if re.fullmatch(r"iter_\d{7}", d))
            raise CheckpointError(f"iteration {iteration}: {directory} does not exist; "
                                  f"saved iterations here: {', '.join(found) or 'none'}")
        return iteration, False
    tracked, release = read_tracker(load_dir)
    if tracked is None:
        hint = inside_a_checkpoint(load_dir)
        if hint:
            raise CheckpointError(hint)
        if os.path.isfile(os.path.join(load_dir, "config.json")):
            raise CheckpointError(f"{load_dir} is a Hugging Face model folder (config.json), "
                                  "not a Megatron-layout checkpoint: read it as one (the "
                                  "tools' --loader hf)")
        steps = sorted(d for d in os.listdir(load_dir) if re.fullmatch(r"iter_\d{7}", d))
        if steps:
            raise CheckpointError(f"{load_dir} holds {', '.join(steps[-6:])} but no "
                                  f"{TRACKER_FILENAME} naming the one to read: give it, with "
                                  f"{_ANOTHER_ITERATION}")
        raise CheckpointError(f"{load_dir} is not a Megatron-layout checkpoint folder: it has "
                              f"no {TRACKER_FILENAME} (a folder pretrain_gpt2.py --save wrote "
                              "has one)")
    return tracked, release


def _check_rank_dirs(directory, size):
    """All of mp_rank_00..size-1 present, nothing beyond."""
    ranks = sorted(int(m.group(1)) for m in map(_RANK_DIR.fullmatch, os.listdir(directory))
                   if m)
    missing = [r for r in range(size) if not os.path.isfile(
        os.path.join(directory, f"mp_rank_{r:02d}", "model_optim_rng.pt"))]
    if missing:
        names = ", ".join(f"mp_rank_{r:02d}/model_optim_rng.pt" for r in missing)
        raise CheckpointError(f"{directory} is incomplete: it was saved with "
                              f"model_parallel_size {size} but {names} is missing. Copy the "
                              "missing rank files, or convert another iteration")
    extra = [r for r in ranks if r >= size]
    if extra:
        raise CheckpointError(f"{directory} holds mp_rank_{extra[0]:02d}, but its mp_rank_00 "
                              f"says model_parallel_size {size}; remove the stray rank "
                              "directories left by another run")


def write_sharded_checkpoint(save_dir, iteration, release, shards, pipeline_stages=1):
    """Write one file per rank (and per pipeline stage: each shard split into
    `pipeline_stages`) under a temporary name, rename it into place, then the tracker.
    `shards` are the ranks' contents in rank order, taken one at a time (a generator can make
    each rank's as it is written).

    A crash leaves either no new iteration directory or a complete one, and the tracker is
    only advanced once every rank's file is in place.  Returns the file paths.
    """
    staged = pipeline_stages > 1
    final = os.path.dirname(os.path.dirname(
        get_checkpoint_name(save_dir, iteration, 0, release, pp_rank=0,
                            pipeline_parallel=staged)))
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists; choose another --save directory or "
                              "delete it first")
    _remove_dead_stagings(save_dir, os.path.basename(final))
    staging = os.path.join(save_dir, f".{os.path.basename(final)}.tmp."
                                     f"{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    names, rank, run_id = [], 0, ""
    try:
        # not enumerate(shards): its reused result tuple would keep the last rank's shards
        # alive while the next rank's are made
        for shard in shards:
            run_id = run_id or (shard.get("train_state") or {}).get("run_id") or ""
            files = split_stages(shard, pipeline_stages)
            del shard
            for stage in range(len(files)):
                path = get_checkpoint_name(save_dir, iteration, rank, release, pp_rank=stage,
                                           pipeline_parallel=staged)
                atomic_torch_save(files[stage],
                                  os.path.join(staging, os.path.relpath(path, final)))
                names.append(path)
            del files  # before the next rank's are made
            rank += 1
        os.replace(staging, final)
    except BaseException:  # an error or Ctrl-C: no half-written copy of a checkpoint stays
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if run_id:  # the run it continues: resumed in place, it is that run's own to prune
        atomic_write_text(run_id_path(save_dir, os.path.basename(final)), run_id)
    _advance_tracker(save_dir, iteration, release)
    return names


def _remove_dead_stagings(save_dir, name):
    """The staging folders of conversions to `name` on this machine whose process is gone
    (killed before their cleanup could run), removed and said. (Another machine's, on a
    shared file system, may be alive: left.)"""
    if not os.path.isdir(save_dir):
        return
    here = socket.gethostname()
    for entry in os.listdir(save_dir):
        match = re.fullmatch(rf"\.{re.escape(name)}\.tmp\.(.+)-(\d+)", entry)
        if match and match.group(1) == here and not _process_alive(int(match.group(2))):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
            print(f" removed {os.path.join(save_dir, entry)}, left by a conversion that was "
                  "killed", flush=True)


def _process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def _advance_tracker(save_dir, iteration, release):
    """Point the tracker at the iteration just written, unless it names a later one (an older
    --iteration converted into a folder holding a newer one): the tracker never goes back,
    as in training, and a note says which iteration --load will read."""
    tracked, tracked_release = read_tracker(save_dir)
    if not release and not tracked_release and tracked is not None and tracked > iteration:
        print(f" note: {save_dir} also holds iteration {tracked}, which its tracker keeps "
              f"naming: --load {save_dir} reads iteration {tracked}, not {iteration} "
              f"(--ckpt-step {iteration} reads it)",
              flush=True)
        return
    atomic_write_text(os.path.join(save_dir, TRACKER_FILENAME),
                      "release" if release else str(iteration))


def trainer_command(load, tp, pp=1):
    """The pretrain_gpt2.py command that loads `load` at tensor-parallel size `tp` and `pp`
    pipeline stages: under torchrun with tp x pp processes (a multiple adds data
    parallelism) unless that is one."""
    launch = "python pretrain_gpt2.py" if tp * pp == 1 else \
        f"torchrun --nproc_per_node {tp * pp} pretrain_gpt2.py"
    stages = f" --pipeline-model-parallel-size {pp}" if pp > 1 else ""
    return f"{launch} --load {shlex.quote(str(load))} --model-parallel-size {tp}{stages}"
