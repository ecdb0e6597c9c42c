"""pretrain(): set up from the resolved config, then train, evaluate and checkpoint.

    config = resolve_config(argv)
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, config)

Set-up order: processes and seeds (megatron/runtime), tokenizer, the model config derived
once from the config and the vocabulary, the backend (model + engine, megatron/training/
backend.py), a resumed checkpoint, datasets, then the loop (megatron/training/loop.py).
"""

import os
import shlex
from dataclasses import dataclass

import torch.distributed as dist
from zero.comm.agreement import disagreements
from zero.comm.communicator import Communicator

from megatron.config.from_checkpoint import TOKENIZER_FILE_KEYS
from megatron.checkpointing.megatron_layout import resuming_own_save
from megatron.checkpointing.retention import new_run_id, other_runs_checkpoints
from megatron.checkpointing.save_dir import claim_output_folders
from megatron.data.tokenization_record import tokenizer_identity
from megatron.errors import CheckpointError, DataError, Interrupted
from megatron.model import GPTConfig
from megatron.runtime.activation_checkpointing import checkpoint_function
from megatron.runtime.fault_tolerance import (TrainingGuards, kill_switch_found,
                                              without_the_chosen_step)
from megatron.runtime.initialize import (Runtime, destroy, initialize_megatron,
                                         seed_pipeline_stage)
from megatron.runtime.rank_failures import fail_together, said_once
from megatron.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.training.backend import build_backend
from megatron.training.loop import evaluate, train
from megatron.training.metrics import TrainingLogger


@dataclass(frozen=True)
class TrainContext:
    """What forward_step and the providers may read: the config, the tokenizer, the model
    config, where we run."""
    config: object  # megatron.config.TrainConfig
    tokenizer: object
    runtime: Runtime
    model_config: GPTConfig

    @property
    def run_args(self):
        """The flat args dict checkpoints record: the config's flags and the vocab sizes. The
        tokenizer files' paths are absolute, so the tools find them from any folder."""
        flat = self.config.as_flat_dict()
        return {**flat, "padded_vocab_size": self.model_config.vocab_size,
                "orig_vocab_size": self.tokenizer.vocab_size,
                "tokenizer_probe_sha1": tokenizer_identity(self.tokenizer)["probe_sha1"],
                **{key: os.path.abspath(flat[key]) for key in TOKENIZER_FILE_KEYS
                   if flat.get(key)}}


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, config):
    """Megatron's entry: providers build datasets and the model; forward_step returns a loss.

    - `model_provider(ctx) -> nn.Module`
    - `train_valid_test_datasets_provider(ctx, [n_train, n_valid, n_test]) -> (ds, ds, ds)`
    - `forward_step_func(batch, model, ctx) -> scalar loss` (mean over counted tokens)
    """
    recompute = config.activation_checkpointing.deepspeed_activation_checkpointing
    runtime = initialize_megatron(config.parallel, recompute,
                                  config.notes + config.activation_checkpointing.notes)
    logger = guards = save_lock = None
    try:
        if kill_switch_found(config.training.kill_switch_file, runtime.device):
            runtime.print0(f" found the kill switch {config.training.kill_switch_file} "
                           "(--kill-switch-file): exiting before training; remove it to train")
            return None
        # before anything is built: a save folder in use or an unwritable folder stops here
        save_lock = claim_output_folders(
            config.checkpoint.save, {"--tensorboard-dir": config.logging.tensorboard_dir,
                                     "--log-dir": config.logging.log_dir},
            runtime.is_rank0, runtime.device)
        data = config.data
        tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file,
                                    data.tokenizer_model)
        ctx = TrainContext(config, tokenizer, runtime,
                           model_config(config, tokenizer.vocab_size))
        # the data first: its mistakes (a missing dataset, another tokenizer's) are the common
        # ones, and finding them must not wait for a large model to be built
        datasets = train_valid_test_datasets_provider(ctx, num_samples_per_split(config))
        backend = build_backend(ctx, model_provider)
        seed_pipeline_stage(config.parallel.seed, runtime.device)
        train_state = {"iteration": 0, "consumed_train_samples": 0, "skipped_iters": 0,
                       "run_id": _agreed_run_id()}  # a resumed run keeps the one it loads
        if config.checkpoint.load:
            loaded = _load_on_every_rank(backend)
            if loaded:
                train_state.update(loaded)
                if config.checkpoint.finetune and train_state["iteration"] == 0:
                    runtime.print0(f" loaded the weights of {config.checkpoint.load} for "
                                   "--finetune: the optimizer, learning-rate schedule, data "
                                   "position and RNG start fresh")
                else:
                    runtime.print0(f" loaded checkpoint from {config.checkpoint.load} at "
                                   f"iteration {train_state['iteration']}")
                for note in backend.resume_notes():
                    runtime.print0(f" note: {note}")
                note = _check_the_samples_ahead(config.training, train_state, datasets[0])
                if note:
                    runtime.print0(note)
                if train_state["iteration"] >= config.training.train_iters:
                    runtime.print0(_nothing_to_train(config.training,
                                                     train_state["iteration"]))
        if runtime.is_rank0:
            _say_if_the_save_folder_holds_other_runs(config, backend, train_state)
        _follow_train_epochs(datasets[0], train_state, ctx)
        logger = TrainingLogger(config.logging.log_dir, config.logging.tensorboard_dir,
                                runtime.is_rank0, start_iteration=train_state["iteration"],
                                tensorboard=config.logging.tensorboard,
                                run_facts={"batch_size": config.training.global_batch_size,
                                           "world_size": runtime.world_size},
                                device=runtime.device)
        guards = TrainingGuards(config, runtime, train_state)  # signals, NaNs, dead peers
        start_iteration = train_state["iteration"]
        with guards.explaining_failures():
            saved_at = train(forward_step_func, backend, datasets, ctx, train_state, logger,
                             guards)
        if guards.interrupted:
            raise Interrupted(_how_to_resume(config) if runtime.is_rank0 else "")
        guards.after_training()
        _final_evaluation(forward_step_func, backend, datasets, ctx, train_state, logger)
        if config.checkpoint.save and saved_at != train_state["iteration"] and \
                _worth_saving(config.checkpoint, train_state["iteration"] > start_iteration):
            backend.save(train_state["iteration"], train_state)
        _print_summary(ctx, backend, train_state, logger)
        return train_state
    finally:
        if logger is not None:
            logger.close()
        if guards is not None:
            guards.close()
        if save_lock is not None:
            save_lock.release()
        destroy()


def model_config(config, vocab_size):
    """The GPTConfig of this run: the config's model section, the vocabulary padded to a
    multiple of --make-vocab-size-divisible-by x --model-parallel-size, and the recompute."""
    model, recompute = config.model, config.activation_checkpointing
    return GPTConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        vocab_size=vocab_size_with_padding(vocab_size, model.make_vocab_size_divisible_by,
                                           config.parallel.model_parallel_size),
        max_position_embeddings=model.max_position_embeddings,
        ffn_hidden_size=model.ffn_hidden_size, hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout, init_method_std=model.init_method_std,
        layernorm_epsilon=model.layernorm_epsilon,
        checkpoint_activations=recompute.checkpoint_activations,
        checkpoint_num_layers=recompute.checkpoint_num_layers,
        split_transformers=recompute.split_transformers,
        checkpoint_function=checkpoint_function(recompute.deepspeed_activation_checkpointing),
        memory_centric_tiled_linear=model.memory_centric_tiled_linear,
        tile_factor=model.tile_factor)


def _worth_saving(checkpoint, trained):
    """The end-of-run save, unless the run trained nothing over the checkpoint it loaded from
    the same folder: saving again would only replace it with this run's settings (another
    --train-iters' schedule)."""
    return trained or not (checkpoint.load and resuming_own_save(checkpoint))


def _nothing_to_train(training, iteration):
    if training.rampup is None:
        return (f" nothing to train: the checkpoint is at iteration {iteration} and "
                f"--train-iters is {training.train_iters}; raise --train-iters (the scripts: "
                "TRAIN_ITERS) to train on")
    return (f" nothing to train: the checkpoint is at iteration {iteration}, and --train-samples "
            f"makes {training.train_iters} iterations under the batch-size ramp; raise "
            "--train-samples (the scripts: TRAIN_ITERS) to train on")


def _check_the_samples_ahead(training, train_state, train):
    """A resumed run's iterations ahead must find their samples: under a ramp the checkpoint
    must have consumed what this run's ramp consumes in as many iterations (another ramp or
    global batch would end the run off --train-samples), and the train split, built for this
    run's batches from the start, must hold the samples ahead (a checkpoint trained at a
    larger --global-batch-size has consumed more of it). Without a ramp, a checkpoint that
    consumed another number of samples than this run's batches would have: a note (the run's
    iterations count on from the checkpoint's)."""
    iteration, consumed = train_state["iteration"], train_state["consumed_train_samples"]
    if iteration == 0:
        return None
    expected = training.samples_after(iteration)
    if training.rampup is not None and consumed != expected:
        ramp = " ".join(map(str, training.rampup_batch_size))
        raise said_once(CheckpointError(
            f"the checkpoint consumed {consumed} samples in {iteration} iterations, where "
            f"--rampup-batch-size {ramp} to --global-batch-size {training.global_batch_size} "
            f"consumes {expected}: it was trained with another ramp or global batch, so this "
            "run's iterations (counted from --train-samples) would not end there. Resume with "
            "the ramp and global batch it was trained with (or --finetune to start afresh)"))
    if iteration >= training.train_iters:
        return None
    needed = consumed + training.samples_after(training.train_iters) - expected
    available = len(train) if train is not None and hasattr(train, "__len__") else needed
    if needed > available:
        raise DataError(
            f"the checkpoint consumed {consumed} samples in {iteration} iterations (at another "
            f"--global-batch-size than this run's {training.global_batch_size}), so the "
            f"{training.train_iters - iteration} iterations ahead need samples up to {needed}, "
            f"but the train split holds {available}, built for this run's batches from the "
            "start: resume with the checkpoint's --global-batch-size")
    if consumed == expected:
        return None
    return (f" note: the checkpoint consumed {consumed} samples in {iteration} iterations, not "
            f"{expected} ({iteration} x --global-batch-size {training.global_batch_size}; it "
            f"was trained with another global batch or a ramp): this run counts on from "
            f"iteration {iteration} to {training.train_iters}, so it ends at {needed} samples")


def num_samples_per_split(config):
    """Samples each split must provide: train for every iteration, valid/test for eval.
    (tools/build_index_maps.py builds maps ahead of a job with the same counts.)"""
    training = config.training
    evaluations = training.train_iters // training.eval_interval + 1
    return [training.samples_after(training.train_iters),
            training.eval_iters * training.global_batch_size * (1 if evaluations else 0),
            training.eval_iters * training.global_batch_size]


def _follow_train_epochs(train, train_state, ctx):
    """Record in `train_state` how many epochs the train split's maps span; when resuming a
    checkpoint whose run spanned another number, say so: the maps shuffle the samples of all
    epochs together (as Megatron's do), so the order is another one from the first sample."""
    num_epochs = getattr(train, "num_epochs", None)
    if num_epochs is None:  # a provider's dataset that does not say
        train_state.pop("train_epochs", None)
        return
    before = train_state.get("train_epochs")
    train_state["train_epochs"] = num_epochs
    if before is None or before == num_epochs or train_state["iteration"] == 0:
        return
    shown_before = before if isinstance(before, int) else ", ".join(map(str, before))
    note = (f" note: the train split's samples now span {_epochs(num_epochs)} (the "
            f"checkpoint's run: {shown_before}), and the samples of all epochs are "
            "shuffled together, as in Megatron: training continues at the checkpoint's count "
            "of consumed samples in another order (some are seen again, some never)")
    if not isinstance(num_epochs, int) or not isinstance(before, int) \
            or ctx.config.training.rampup is not None:  # a blend's; a ramp's iterations vary
        ctx.runtime.print0(note)
        return
    global_batch = ctx.config.training.global_batch_size
    fewest, most = train.sample_counts_spanning(before)
    lowest = max(-(-fewest // global_batch), train_state["iteration"] + 1)
    if lowest <= most // global_batch:
        note += (f"; --train-iters {lowest} to {most // global_batch} at global batch size "
                 f"{global_batch} would keep the checkpoint's order")
    ctx.runtime.print0(note)


def _epochs(num_epochs):
    """One dataset's epoch count, or each of a blend's."""
    if isinstance(num_epochs, int):
        return f"{num_epochs} epoch(s) of its documents"
    return f"{', '.join(map(str, num_epochs))} epochs of its datasets' documents"


def _how_to_resume(config):
    save, load = config.checkpoint.save, config.checkpoint.load
    if not save:
        return " stopped by Ctrl-C; nothing was saved (no --save)"
    again = "the same command" if load and os.path.abspath(load) == os.path.abspath(save) \
        else f"the same command with --load {shlex.quote(save)}"
    return f" stopped by Ctrl-C after saving to {save}; to resume, run {again}" + \
        without_the_chosen_step(config.checkpoint.load_step)


def _final_evaluation(forward_step_func, backend, datasets, ctx, train_state, logger):
    training = ctx.config.training
    if train_state["iteration"] < training.train_iters or training.eval_iters == 0:
        return
    for split, dataset in (("valid", datasets[1]), ("test", datasets[2])):
        if dataset is not None:
            loss = evaluate(forward_step_func, backend, dataset, ctx)
            logger.log_eval(train_state["iteration"], split, loss)



def _print_summary(ctx, backend, state, logger):
    config = ctx.config
    if not ctx.runtime.is_rank0:
        return
    lines = [f" training finished at iteration {state['iteration']}"]
    if config.checkpoint.save:
        lines.append(f" checkpoint:   {os.path.abspath(config.checkpoint.save)} "
                     f"({backend.checkpoint_tag(state['iteration'])})")
    log_dir, tensorboard_dir = config.logging.log_dir, config.logging.tensorboard_dir
    if log_dir:
        lines.append(f" metrics:      {os.path.abspath(os.path.join(log_dir, 'metrics.jsonl'))}")
    if logger.writes_tensorboard:  # not when the tensorboard package is missing
        lines.append(" tensorboard:  tensorboard --logdir "
                     + shlex.quote(os.path.abspath(tensorboard_dir)))
    print("\n".join(lines), flush=True)


def _load_on_every_rank(backend):
    """backend.load(), which every rank passes or fails together: a rank whose files are
    missing or damaged stops the others here, rather than leave them in a collective it never
    joins. The fp32 masters a ZeRO load restores reach the model (an all-gather) only after
    this agreement (backend.finish_load); loads make no collective before it, and rank 0 says
    each rank's failure once (fail_together). The ranks must
    then have loaded the same iteration: a --load folder that differs between nodes (their own
    disks) is said here, not found in a later collective."""
    error = loaded = None
    try:
        loaded = backend.load()
    except Exception as e:  # noqa: BLE001 -- raised by fail_together, after the others know
        error = e
    fail_together(error, "load the checkpoint", CheckpointError)
    differ = disagreements({"the iteration loaded (None: nothing)":
                            None if loaded is None else loaded["iteration"]}, Communicator())
    if differ:
        raise said_once(CheckpointError(
            f"the ranks did not load the same checkpoint: {differ[0]}. Every rank reads --load "
            "itself: on a folder each node keeps on its own disk, give every node the same copy"))
    backend.finish_load()
    return loaded


def _agreed_run_id():
    """A new run id (checkpoint ownership, see retention.py), rank 0's on every rank."""
    chosen = [new_run_id()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _say_if_the_save_folder_holds_other_runs(config, backend, train_state):
    others = other_runs_checkpoints(config.checkpoint.save, backend.layout,
                                    train_state["run_id"])
    if others:
        print(f" note: --save {config.checkpoint.save} holds {len(others)} checkpoint(s) of "
              f"another run ({others[0]} ... {others[-1]}); this run's checkpoints replace "
              "those of the same iteration, and --keep-last-n-checkpoints never removes the "
              "others", flush=True)
