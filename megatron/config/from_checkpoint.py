"""What a `--load` checkpoint supplies: the model's shape and tokenizer.

A checkpoint records the arguments it was trained with (a converted one records the model's
shape, vocab and tokenizer files), so

    python pretrain_gpt2.py --load checkpoints/converted --save out --data-path ... \
        --batch-size 8 --train-iters 100 --lr 1e-4

needs no model flags. Every key of `FROM_CHECKPOINT` the user did not give on the command
line is taken from the checkpoint, with one note listing them; a flag the user did give keeps
its value, and loading rejects it later when it disagrees with the checkpoint.

Also checked here, before anything is built: that `--load` can be a checkpoint folder, and
which of its iterations loads (the tracker's, or --ckpt-step / --load-tag's).
"""

import math
import os
import re

from megatron.data.data_path import parse_data_path
from megatron.data.splits import parse_splits
from megatron.errors import CheckpointError, MegatronError

# Shape, vocab and tokenizer: what the model needs to be rebuilt as it was saved.
FROM_CHECKPOINT = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                   "max_position_embeddings", "make_vocab_size_divisible_by",
                   "layernorm_epsilon", "seq_length", "tokenizer_type", "vocab_file",
                   "merge_file", "tokenizer_model")
# --model-size fills these itself; given, it counts as giving them.
_NAMED_SIZE_KEYS = ("num_layers", "hidden_size", "num_attention_heads")
TOKENIZER_FILE_KEYS = ("vocab_file", "merge_file", "tokenizer_model")
_FILES_READ_BY = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
                  "SentencePieceTokenizer": ("tokenizer_model",)}
# The model-states file of tensor-parallel rank 0 in DeepSpeed's layout: stages 0-2, stage 3.
_DEEPSPEED_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# the checkpoint folders of one iteration: DeepSpeed's layout, Megatron's
_STEP_FOLDER = re.compile(r"global_step(\d+)|iter_(\d{7})")


def tokenizer_files_beside(args, load_dir):
    """{key: path} for each tokenizer file the checkpoint `args` record that is not where
    recorded but is in the checkpoint folder `load_dir` itself: a converted folder holds its
    tokenizer's files, and once moved its recorded absolute paths name the old place."""
    moved = {}
    for key in TOKENIZER_FILE_KEYS:
        recorded = args.get(key)
        if isinstance(recorded, str) and recorded and not os.path.isfile(recorded):
            beside = os.path.join(load_dir, os.path.basename(recorded))
            if os.path.isfile(beside):
                moved[key] = os.path.abspath(beside)
    return moved


def load_step(raw):
    """The iteration --ckpt-step or --load-tag asks to load; None: the one the tracker names."""
    step, tag = raw.get("ckpt_step"), raw.get("load_tag")
    if tag is not None:
        match = _STEP_FOLDER.fullmatch(tag)
        if match is None:
            raise CheckpointError(
                f"--load-tag {tag!r}: this trainer's checkpoint folders are global_stepN "
                "(--deepspeed) and iter_NNNNNNN; give one of those, or the iteration as "
                "--ckpt-step N")
        tagged = int(match.group(1) or match.group(2))
        if step is not None and step != tagged:
            raise CheckpointError(f"--ckpt-step {step} and --load-tag {tag} name different "
                                  "iterations; give one")
        step = tagged
    if step is None:
        return None
    spelled = _step_flag(raw)
    if step < 0:
        raise CheckpointError(f"{spelled} must be 0 or more, got {step}")
    if not raw.get("load"):
        raise CheckpointError(f"{spelled} needs --load (the folder holding that checkpoint)")
    return step


def _step_flag(raw):
    tag = raw.get("load_tag")
    return f"--load-tag {tag}" if tag is not None else f"--ckpt-step {raw.get('ckpt_step')}"


def saved_steps(load_dir):
    """The iterations of the checkpoint folders in `load_dir` (either layout) that hold files
    (not the empty shells an interrupted save's clean-up leaves), ascending."""
    steps = set()
    for name in os.listdir(load_dir):
        match = _STEP_FOLDER.fullmatch(name)
        if match and any(files for _, _, files in os.walk(os.path.join(load_dir, name))):
            steps.add(int(match.group(1) or match.group(2)))
    return sorted(steps)


def _chosen_step_notes(raw, load, step):
    """--ckpt-step: the folder must hold that iteration's checkpoint; a note when a newer one
    is there (the run goes on from the older: a rollback)."""
    spelled = _step_flag(raw)
    if not os.path.isdir(load):
        raise CheckpointError(f"{spelled}: --load {load} does not exist")
    steps = saved_steps(load)
    if step not in steps:
        held = ", ".join(map(str, steps[-12:])) if steps else "none"
        release = "; its 'release' checkpoint loads without the flag" \
            if os.path.isdir(os.path.join(load, "release")) else ""
        raise CheckpointError(f"{spelled}: --load {load} holds no checkpoint of iteration "
                              f"{step} (its iterations: {held}){release}")
    if steps[-1] <= step:
        return ()
    again = ""
    if raw.get("save") and os.path.realpath(load) == os.path.realpath(raw["save"]):
        again = (f"; this run saves over the later ones as it reaches them, and a restart "
                 f"given {spelled} again goes back to {step} again: drop the flag once this "
                 "run has saved")
    return (f" note: {spelled}: loading iteration {step} of --load {load}, not its newest "
            f"({steps[-1]}){again}",)


def saved_args_of(load_dir, deepspeed=False, step=None):
    """The `args` dict recorded in the checkpoint at `load_dir` (of iteration `step`, or the
    one the tracker names); None when there is none."""
    state = _first_rank_state(load_dir, deepspeed, step)
    saved = state.get("args") if isinstance(state, dict) else None
    return saved if isinstance(saved, dict) else None


def _first_rank_state(load_dir, deepspeed, step):
    """The first rank's checkpoint file at `load_dir` (memory-mapped), or None."""
    if not load_dir or not os.path.isdir(load_dir):
        return None
    path = _deepspeed_states_path(load_dir, step) if deepspeed else \
        _megatron_path(load_dir, step)
    if path is None or not os.path.isfile(path):
        return None  # a missing file is reported by the load itself, with its full context
    # torch: only when there is a checkpoint
    from megatron.checkpointing.files import safe_load
    from megatron.checkpointing.megatron_lm import as_this_layout
    try:
        return as_this_layout(safe_load(path, mmap=True), path)
    except Exception:  # noqa: BLE001 -- the load itself reports a damaged file properly
        return None


def _megatron_path(load_dir, step):
    from megatron.checkpointing.megatron_layout import (first_rank_checkpoint_name,
                                                        iteration_to_load)
    iteration, release = iteration_to_load(load_dir, step)
    if iteration is None:
        return None
    return first_rank_checkpoint_name(load_dir, iteration, release=release)


def _deepspeed_states_path(load_dir, step):
    from megatron.checkpointing.deepspeed_layout import tag_to_load
    tag = tag_to_load(load_dir, step)
    if tag is None:
        return None
    for name in _DEEPSPEED_STATES:
        path = os.path.join(load_dir, tag, name)
        if os.path.isfile(path):
            return path
    return None


def load_dir_notes(raw):
    """--load checked as given: a checkpoint folder, or one that holds none yet (a note: the
    run starts from scratch, as Megatron-LM's does, unless --exit-on-missing-checkpoint); one
    error for what cannot be one (a file, a folder that does not exist unless it is --save
    too, a Hugging Face folder) and for --finetune with nothing to fine-tune from."""
    load, finetune = raw.get("load"), raw.get("finetune")
    if not load:
        for dest, what in (("exit_on_missing_checkpoint", "the folder a checkpoint must be "
                                                          "found in"),
                           ("finetune", "the checkpoint whose weights it starts from"),
                           ("use_checkpoint_args", "the checkpoint whose model flags it "
                                                   "takes")):
            if raw.get(dest):
                raise CheckpointError(f"--{dest.replace('_', '-')} needs --load ({what})")
        return ()
    from megatron.checkpointing.megatron_layout import TRACKER_FILENAME
    trackers = (TRACKER_FILENAME, "latest")  # (DeepSpeed's layout: 'latest')
    own_save = bool(raw.get("save")) and os.path.realpath(load) == os.path.realpath(raw["save"])
    if os.path.isfile(load):
        above = [os.path.dirname(os.path.abspath(load))]
        for _ in range(3):
            above.append(os.path.dirname(above[-1]))
        folder = next((d for d in above if any(os.path.isfile(os.path.join(d, name))
                                               for name in trackers)), None)
        raise CheckpointError(
            f"--load {load} is a file; --load takes a checkpoint folder (the one holding "
            f"{TRACKER_FILENAME}, or 'latest' for --deepspeed)"
            + (f": here {folder}" if folder else ""))
    if not any(os.path.isfile(os.path.join(load, name)) for name in trackers):
        _refuse_a_folder_inside_a_checkpoint(load)
    step = load_step(raw)
    if step is not None:
        return _chosen_step_notes(raw, load, step)
    must_resume = raw.get("exit_on_missing_checkpoint")
    if not os.path.exists(load):
        if must_resume:
            raise _no_checkpoint_to_resume(load, "does not exist")
        if own_save and not finetune:
            return (f" note: --load {load} does not exist yet (it is --save too): training "
                    "starts from scratch",)
        raise CheckpointError(f"--load {load} does not exist: give a checkpoint folder"
                              + ("" if finetune else ", or leave --load out to train from "
                                 "scratch"))
    if any(os.path.isfile(os.path.join(load, name)) for name in trackers):
        return ()
    untracked = saved_steps(load)
    if untracked:
        if own_save and not finetune and not must_resume:
            return (f" note: --load {load} holds iteration {untracked[-1]}'s folder but no "
                    f"{TRACKER_FILENAME} naming a complete checkpoint (a first save cut "
                    "short?): training starts from scratch; --ckpt-step "
                    f"{untracked[-1]} loads it if it is whole",)
        raise CheckpointError(
            f"--load {load} holds the folders of iteration(s) "
            f"{', '.join(map(str, untracked[-12:]))} but no {TRACKER_FILENAME} (nor 'latest' "
            f"for --deepspeed) naming the one to load: give --ckpt-step {untracked[-1]}, or "
            f"write {untracked[-1]} into {os.path.join(load, TRACKER_FILENAME)}")
    if os.path.isfile(os.path.join(load, "config.json")):
        raise CheckpointError(
            f"--load {load} is a Hugging Face model folder (config.json), not a checkpoint of "
            f"this trainer: convert it first, python tools/convert_checkpoint.py --load-dir "
            f"{load} --save-dir DIR --saver megatron, then --load DIR")
    if must_resume:
        raise _no_checkpoint_to_resume(load, f"holds no checkpoint (no {TRACKER_FILENAME}, "
                                             "nor 'latest' for --deepspeed)")
    if finetune:
        raise CheckpointError(f"--finetune: --load {load} holds no checkpoint (no "
                              f"{TRACKER_FILENAME}, nor 'latest' for --deepspeed)")
    if os.listdir(load) and not own_save:
        return ()  # the load says what the folder holds instead
    return (f" note: --load {load} holds no checkpoint yet: training starts from scratch",)


def _refuse_a_folder_inside_a_checkpoint(load):
    """--load .../iter_0000003 or .../global_step3, or a rank folder mp_rank_NN in one (and
    no tracker of its own): the folder above is the checkpoint folder."""
    inside = os.path.abspath(load)
    if re.fullmatch(r"mp_rank_\d{2}(_\d{3})?", os.path.basename(inside)):
        inside = os.path.dirname(inside)
    match = _STEP_FOLDER.fullmatch(os.path.basename(inside))
    if match and os.path.isdir(load):
        step = int(match.group(1) or match.group(2))
        raise CheckpointError(f"--load {load} is inside a checkpoint folder: --load takes the "
                              f"folder above it, {os.path.dirname(inside)} (--ckpt-step {step} "
                              "loads this iteration)")


def _no_checkpoint_to_resume(load, what):
    return CheckpointError(f"--exit-on-missing-checkpoint: --load {load} {what}, so the run "
                           "stops instead of training from scratch")


def values_from_checkpoint(raw, given):
    """{flag: value} for each FROM_CHECKPOINT flag not in `given` that the checkpoint at
    raw["load"] records differently; `raw` is the parsed command line."""
    saved = saved_args_of(raw.get("load"), raw.get("deepspeed", False), load_step(raw))
    if saved is None:
        return {}
    saved = {**saved, **tokenizer_files_beside(saved, raw["load"])}
    skip = set(given)
    if "model_size" in given:
        skip.update(_NAMED_SIZE_KEYS)
    if given & {"tokenizer_type", *TOKENIZER_FILE_KEYS}:
        # A tokenizer named on the command line replaces the recorded one as a whole; files
        # alone, of the kind the recorded type reads, keep that type (not the default).
        skip.update(("tokenizer_type", *TOKENIZER_FILE_KEYS))
        if "tokenizer_type" not in given and given & set(TOKENIZER_FILE_KEYS) <= set(
                _FILES_READ_BY.get(saved.get("tokenizer_type"), ())):
            skip.discard("tokenizer_type")
    taken = {}
    hidden_size = raw.get("hidden_size") or saved.get("hidden_size")
    for key in FROM_CHECKPOINT:
        value = saved.get(key)
        if key in skip or value is None or raw.get(key) == value:
            continue
        if key == "ffn_hidden_size" and raw.get(key) is None and hidden_size is not None \
                and (value == 4 * hidden_size or hidden_size != saved.get("hidden_size")):
            # what the default derives anyway: not worth a word on every resume; or another
            # --hidden-size given, whose own default follows it (the load lists both)
            continue
        if key in TOKENIZER_FILE_KEYS and not os.path.isfile(value):
            raise CheckpointError(
                f"checkpoint {raw['load']} records --{key.replace('_', '-')} {value}, which does "
                "not exist here; give the tokenizer files on the command line")
        taken[key] = value
    return taken


def describe(load_dir, taken):
    """The one line that says what was taken from the checkpoint."""
    return " taking from checkpoint " + load_dir + ": " + ", ".join(
        f"--{key.replace('_', '-')} {value}" for key, value in taken.items())


# optimizer settings that a loaded optimizer state brings with it (torch's load_state_dict
# takes the saved parameter groups' values, as Megatron's resume does)
_SAVED_WITH_OPTIMIZER_STATE = ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps")
# what decides the order of the training samples, which a resume continues by count
_SAMPLE_ORDER = ("data_path", "train_data_path", "valid_data_path", "test_data_path",
                 "train_data", "split", "seq_length", "seed")


def resume_notes(raw):
    """Lines for what resuming the checkpoint at --load does that the flags alone do not show:
    the optimizer (another --optimizer's states converted, settings the loaded state keeps,
    --no-load-optim's fresh start) and a sample order that changed under the same count."""
    if raw.get("finetune"):
        return ()
    state = _first_rank_state(raw.get("load"), raw.get("deepspeed", False), load_step(raw))
    saved = state.get("args") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        return ()
    # a Megatron-layout file without optimizer state (a converted checkpoint) loads none
    loads_optimizer = raw.get("deepspeed") or "optimizer" in state
    return _optimizer_notes(raw, saved, loads_optimizer) + _sample_order_notes(raw, saved)


def _optimizer_notes(raw, saved, loads_optimizer):
    if raw.get("no_load_optim"):
        return (" note: --no-load-optim: the optimizer state and the learning-rate schedule "
                "start fresh, as in Megatron (Adam's moments at zero, warm-up again from step "
                "0) while the iteration count continues from the checkpoint's",)
    if not loads_optimizer or (raw.get("deepspeed") and _json_chooses_the_optimizer(raw)):
        return ()  # nothing of the checkpoint's optimizer reaches this run (or the engine checks)
    notes = []
    before = saved.get("optimizer", "adam")
    if before != raw["optimizer"]:
        notes.append(f" note: the checkpoint was trained with --optimizer {before}; its Adam "
                     f"states are converted for --optimizer {raw['optimizer']} as they load")
    overridden = [f"--{key.replace('_', '-')} {raw[key]} (the checkpoint's: {saved[key]})"
                  for key in _SAVED_WITH_OPTIMIZER_STATE
                  if saved.get(key) is not None and saved[key] != raw.get(key)]
    if overridden:
        notes.append(f" note: {', '.join(overridden)}: the loaded optimizer state keeps the "
                     "checkpoint's values, as in Megatron; resume with --no-load-optim to use "
                     "the command line's")
    return tuple(notes)


def _json_chooses_the_optimizer(raw):
    """Whether the run's DeepSpeed JSON has an optimizer section (True when it cannot be
    read: the engine's parse says why, and there is nothing to compare the flags with)."""
    from zero.errors import ZeroError
    from megatron.config.engine import load_deepspeed_json
    try:
        config, _ = load_deepspeed_json(raw)
    except (MegatronError, ZeroError):
        return True
    return isinstance(config, dict) and config.get("optimizer") is not None


def _same_path(ours, theirs):
    """As written, or resolved."""
    return os.path.normpath(str(ours)) == os.path.normpath(str(theirs)) or \
        os.path.realpath(str(ours)) == os.path.realpath(str(theirs))


def _same_data_path(ours, theirs):
    """--data-path values (a checkpoint from before blends recorded one string): the same
    datasets by the same weights ("1 A" is "A")."""
    as_list = lambda value: [value] if isinstance(value, str) else list(value)  # noqa: E731
    try:
        ours, theirs = parse_data_path(as_list(ours)), parse_data_path(as_list(theirs))
    except MegatronError:  # a bad recorded value: the values decide
        return as_list(ours) == as_list(theirs)
    if len(ours.prefixes) != len(theirs.prefixes) or not all(
            _same_path(a, b) for a, b in zip(ours.prefixes, theirs.prefixes)):
        return False
    if len(ours.prefixes) == 1 or ours.weights == theirs.weights:
        return True
    return ours.weights is not None and theirs.weights is not None and all(
        math.isclose(a, b, rel_tol=1e-9) for a, b in zip(ours.weights, theirs.weights))


def _shown(value):
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value


def _sample_order_notes(raw, saved):
    def same(key):
        ours, theirs = raw.get(key), saved.get(key)
        if key.endswith("data_path") and ours and theirs:
            return _same_data_path(ours, theirs)
        if key == "train_data" and ours and theirs:
            return _same_path(ours, theirs)
        if key == "split" and ours and theirs:  # "969, 30, 1" is "969,30,1"
            try:
                return parse_splits(str(ours)) == parse_splits(str(theirs))
            except MegatronError:  # a bad recorded split: the strings decide
                return ours == theirs
        return ours == theirs
    changed = [f"--{key.replace('_', '-')} {_shown(raw.get(key))} (the checkpoint's: "
               f"{_shown(saved[key])})"
               for key in _SAMPLE_ORDER if key in saved and not same(key)]
    if not changed:
        return ()
    note = (f" note: {', '.join(changed)}: training continues at the checkpoint's count of "
            "consumed samples, in another order of samples (as in Megatron: some are seen "
            "again, some never)")
    if any(item.startswith(("--split", "--data-path", "--train-data", "--valid-data-path",
                            "--test-data-path")) for item in changed):
        note += ("; validation and test may now hold documents the model trained on")
    return (note,)
