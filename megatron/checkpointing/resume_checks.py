"""What a Megatron-layout checkpoint must agree with before it loads (the model's shape and
parallel layout, its tokenizer, its tiling for the optimizer state), and what a missing rank
file means: each mismatch one error that names the difference and the way out (the flags it
was trained with, or tools/merge_mp_partitions.py)."""

import os
import re

from megatron.checkpointing.files import safe_load
from megatron.checkpointing.megatron_lm import as_this_layout
from megatron.errors import CheckpointError


# what a checkpoint's model must agree with (the LayerNorm epsilon too: with another, the
# same weights compute another function, which the tools refuse as well)
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "max_position_embeddings", "make_vocab_size_divisible_by",
                    "padded_vocab_size", "tokenizer_type", "model_parallel_size",
                    "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                    "layernorm_epsilon")


def check_checkpoint_args(saved_args, run_args, path):
    """Raise CheckpointError listing every shape-defining flag that differs."""
    differences = []
    for key in MODEL_SHAPE_ARGS:
        if key not in saved_args:
            continue
        ours, saved = run_args.get(key), saved_args[key]
        if key == "ffn_hidden_size" and saved is None:  # recorded before it was resolved
            saved = 4 * saved_args.get("hidden_size", run_args["hidden_size"])
        if saved != ours and key == "padded_vocab_size":  # (no flag: the tokenizer's)
            files = ", ".join(f"--{name.replace('_', '-')} {saved_args[name]}" for name in (
                "vocab_file", "merge_file", "tokenizer_model") if saved_args.get(name))
            differences.append(f"the vocabulary padded to a multiple of --make-vocab-size-"
                               f"divisible-by: checkpoint {saved}, this run's tokenizer {ours}"
                               + (f" (the checkpoint's tokenizer: {files})" if files else ""))
        elif saved != ours:
            differences.append(f"--{key.replace('_', '-')}: checkpoint {saved}, flags {ours}")
    if differences and all(d.startswith(_LAYOUT_FLAGS) for d in differences):
        raise CheckpointError(f"checkpoint {path} was saved at another parallel layout:\n  "
                              + "\n  ".join(differences) + "\n" + _convert_layout_hint(run_args))
    if differences and all(d.startswith("--layernorm-epsilon") for d in differences):
        raise CheckpointError(f"checkpoint {path} was trained with {differences[0]}: with "
                              "another epsilon its weights compute another function. Give the "
                              "checkpoint's (or leave --layernorm-epsilon out: it is taken "
                              "from the checkpoint)")
    if differences:
        hint = ""
        if run_args.get("load") and run_args.get("save") and \
                os.path.realpath(run_args["load"]) == os.path.realpath(run_args["save"]):
            hint = (f"\nThis run saves where it loads ({run_args['save']}), and that folder "
                    "holds an earlier run of another model: to train the new model, give it "
                    "its own folder (the scripts: CHECKPOINT_DIR=checkpoints/<new name>).")
        advice = "\n--finetune loads the weights into the same shape: give the checkpoint's " \
            "(or leave the shape flags out: they are taken from it)." if run_args.get(
                "finetune") else "\nUse the flags it was trained with, or --finetune from a " \
            "matching shape."
        raise CheckpointError(f"checkpoint {path} was saved for a different model:\n  "
                              + "\n  ".join(differences) + advice + hint)
    check_same_tokenizer(saved_args, run_args, path)


_LAYOUT_FLAGS = ("--model-parallel-size", "--pipeline-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage")


def _convert_layout_hint(run_args):
    """How to take a checkpoint to this run's tensor-parallel size and pipeline stages."""
    tp = run_args.get("model_parallel_size") or 1
    pp = run_args.get("pipeline_model_parallel_size") or 1
    load = run_args.get("load") or "<checkpoint>"
    target = f"{load.rstrip('/')}_mp{tp}" + (f"_pp{pp}" if pp > 1 else "")
    command = (f"Resume it with the sizes it was saved with, or convert it to these: python "
               f"tools/merge_mp_partitions.py{' --deepspeed' if run_args.get('deepspeed') else ''}"
               f" --load {load} --target-model-parallel-size {tp} "
               f"--target-pipeline-model-parallel-size {pp} --save {target}, then --load {target}")
    if not run_args.get("deepspeed"):
        return command + " (the optimizer state is converted too)"
    return (command + ", with or without --deepspeed (it writes Megatron's layout, with the "
            "optimizer state; add --no-load-optim where the tool says it was not converted: "
            "tiled linears)")


# what the run records of its tokenizer: the ids the embedding rows stand for
TOKENIZER_ARGS = ("orig_vocab_size", "tokenizer_probe_sha1")


def check_same_tokenizer(saved_args, run_args, path):
    """CheckpointError when the checkpoint records another tokenizer than this run's: two
    vocabularies that pad to the same size still give the embedding rows other meanings."""
    if saved_args.get("tokenizer_type") is None:
        return  # its orig_vocab_size counts embedding rows (a Hugging Face conversion)
    differs = [key for key in TOKENIZER_ARGS
               if saved_args.get(key) is not None and run_args.get(key) is not None
               and saved_args[key] != run_args[key]]
    if differs:
        def described(args):
            return (f"{args.get('orig_vocab_size')} tokens, probe hash "
                    f"{str(args.get('tokenizer_probe_sha1'))[:8]}")
        raise CheckpointError(
            f"checkpoint {path} was trained with another tokenizer ({described(saved_args)}) "
            f"than this run's ({described(run_args)}): its embedding rows would stand for "
            "other tokens. Pass the tokenizer files it was trained with (--vocab-file and "
            "--merge-file, or --tokenizer-model)")


def explain_missing_file(load_dir, iteration, path, directory, run_args, tracker):
    """The CheckpointError for this rank's missing file: another layout's checkpoint, or an
    incomplete one (`tracker`: the file that names the iteration)."""
    deepspeed_tag = os.path.join(load_dir, f"global_step{iteration}")
    if os.path.isdir(deepspeed_tag):
        raise CheckpointError(
            f"--load {load_dir} holds a --deepspeed checkpoint (DeepSpeed's layout: "
            f"{deepspeed_tag}), not Megatron's. Resume it with the --deepspeed "
            "--deepspeed_config flags it was trained with, or convert it first: python "
            f"tools/merge_mp_partitions.py --deepspeed --load {load_dir} --save <dir>, "
            "then --load <dir>")
    # Without our rank's file, another rank's tells the saved size (or, unreadable, the rank
    # directories present).
    _check_pipeline_stages(run_args, directory)
    check_model_parallel_size(load_dir, run_args, directory, _recorded_size(directory))
    raise CheckpointError(f"{tracker} names iteration "
                          f"{iteration}, but {path} is missing: the checkpoint is "
                          "incomplete. Resume from an earlier iteration (--ckpt-step N) or "
                          "save again")


def optimizer_state_tiling_mismatch(saved_args, run_args):
    """Why a checkpoint's optimizer state cannot be loaded under these tiling flags, or None.

    Model weights are saved untiled and load either way; the optimizer state is a list over
    parameters, and tiling changes that list.
    """
    def grid(values):
        tiled = bool(values.get("memory_centric_tiled_linear", False))
        return f"--memory-centric-tiled-linear --tile-factor {values.get('tile_factor') or 1}" \
            if tiled else "no --memory-centric-tiled-linear"
    saved, ours = grid(saved_args), grid(run_args)
    if saved == ours:
        return None
    return (f"the checkpoint was trained with {saved} but this run has {ours}: its model "
            "weights load either way, its optimizer state does not (tiling changes the "
            "parameter list). Resume with --no-load-optim (or --finetune), or with the "
            "checkpoint's tiling flags")


def _recorded_size(directory):
    """The tensor-parallel size the first readable rank file of an iteration directory
    records, else the number of rank files there (None if none)."""
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        path = os.path.join(directory, name, "model_optim_rng.pt")
        if re.fullmatch(r"mp_rank_\d{2}(_\d{3})?", name) and os.path.isfile(path):
            try:
                return int(as_this_layout(safe_load(path, mmap=True), path)["args"][
                    "model_parallel_size"])
            except (CheckpointError, KeyError, TypeError, ValueError):
                continue
    return _count_rank_files(directory)


def _count_rank_files(directory):
    """How many tensor-parallel ranks wrote into an iteration directory (None if none)."""
    if not os.path.isdir(directory):
        return None
    ranks = [d for d in os.listdir(directory) if re.fullmatch(r"mp_rank_\d{2}", d) and
             os.path.isfile(os.path.join(directory, d, "model_optim_rng.pt"))]
    return len(ranks) or None


def _check_pipeline_stages(run_args, directory):
    """A checkpoint saved with another number of pipeline stages: say so."""
    if not os.path.isdir(directory):
        return
    stages = {int(m.group(1)) for d in os.listdir(directory)
              if (m := re.fullmatch(r"mp_rank_\d{2}_(\d{3})", d))}
    saved = max(stages) + 1 if stages else 1
    ours = run_args.get("pipeline_model_parallel_size", 1)
    if saved != ours and any(re.fullmatch(r"mp_rank_\d{2}(_\d{3})?", d)
                             for d in os.listdir(directory)):
        raise CheckpointError(
            f"checkpoint {directory} was saved with --pipeline-model-parallel-size {saved}, "
            f"but this run uses {ours}: its stages hold other layers. Load it with "
            f"--pipeline-model-parallel-size {saved}, or convert it: python "
            f"tools/merge_mp_partitions.py --load <dir> --target-pipeline-model-parallel-size "
            f"{ours}")


def check_model_parallel_size(load_dir, run_args, directory, saved_size):
    """A checkpoint saved at another TP size must be converted, not loaded: say how."""
    ours = run_args["model_parallel_size"]
    if saved_size is None or saved_size == ours:
        return
    converted = f"{os.path.normpath(load_dir)}_mp{ours}"
    raise CheckpointError(
        f"checkpoint {directory} was saved with --model-parallel-size {saved_size}, but this "
        f"run uses --model-parallel-size {ours}. Convert it to the new size first:\n"
        f"  python tools/merge_mp_partitions.py --load {load_dir} "
        f"--target-model-parallel-size {ours} --save {converted}\n"
        f"then resume with --load {converted} (or run with --model-parallel-size {saved_size})")
