"""What pipeline parallelism composes with, checked once at start-up, and the notes it leaves
for the log (the stages' layer split, the bubble of few micro batches, recompute chunks)."""

from megatron.errors import ConfigError, require


def check_pipeline(raw, parallel, training, ds_config):
    """What pipeline parallelism composes with; the notes it leaves for the log."""
    pp = parallel.pipeline_model_parallel_size
    if pp == 1:
        return ()
    from megatron.model.gpt2_model import check_pipeline_split
    check_pipeline_split(raw["num_layers"], pp)
    require(ds_config.zero_optimization.stage < 3,
            "ZeRO stage 3 does not compose with --pipeline-model-parallel-size (as in "
            "DeepSpeed's PipelineEngine): each stage already holds only its own layers. Use "
            "ZeRO stage 0, 1 or 2")
    require(not (raw["DDP_impl"] == "torch" and not raw["deepspeed"]
                 and parallel.data_parallel_size > 1),
            "--DDP-impl torch does not compose with --pipeline-model-parallel-size; use "
            "--DDP-impl local (the engine's buckets, also overlapped with backward)")
    chunks = parallel.virtual_pipeline_model_parallel_size
    m = training.num_micro_batches
    if chunks > 1:
        per_step = training.global_batch_size // m
        uneven = training.global_batch_size if m % pp else None
        if uneven is None and training.rampup is not None:
            uneven = training.rampup.first_size_not_a_multiple_of(pp * per_step)
        if uneven is not None:
            ramp = " and --rampup-batch-size" if training.rampup else ""
            count = uneven // per_step
            raise ConfigError(
                f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage) runs the "
                f"micro batches in groups of --pipeline-model-parallel-size {pp}, but a step "
                f"has {count} ({count} % {pp} = {count % pp}); make --global-batch-size{ramp} "
                f"a multiple of {pp * per_step}")
        require(ds_config.zero_optimization.stage < 2,
                "the interleaved schedule reduces the gradients once, after the step's last "
                "backward; ZeRO stage 2 reduces them at every micro batch. Use ZeRO stage 0 "
                "or 1 with --num-layers-per-virtual-pipeline-stage")
    notes = []
    per_virtual = parallel.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None and chunks == 1:
        smaller = "a divisor of it below that interleaves" if per_virtual > 1 else \
            "interleaving needs 2 or more layers a stage"
        notes.append(f" note: --num-layers-per-virtual-pipeline-stage {per_virtual} is all of "
                     f"each stage's {per_virtual} layers: one model chunk a stage, so the "
                     f"schedule is plain 1F1B ({smaller})")
    base, extra = divmod(raw["num_layers"], pp)
    if extra:
        notes.append(f" note: --num-layers {raw['num_layers']} over {pp} pipeline stages: the "
                     f"first {extra} stage(s) hold {base + 1} layers, the others {base}")
    if m < pp:
        suggested = 4 * pp * training.batch_size * parallel.data_parallel_size
        notes.append(f" note: {m} micro batch(es) per step over {pp} pipeline stages: each stage "
                     f"idles {(pp - 1) / (m + pp - 1):.0%} of the step ((P-1)/(m+P-1)); "
                     f"--global-batch-size {suggested} ({4 * pp} micro batches) brings that "
                     f"to {(pp - 1) / (5 * pp - 1):.0%}")
    first = m if training.rampup is None else \
        training.micro_batches_in(training.rampup.global_batch_at(0))
    if first < pp <= m:
        notes.append(f" note: --rampup-batch-size starts at {first} micro batch(es) per step "
                     f"over {pp} pipeline stages: each stage idles "
                     f"{(pp - 1) / (first + pp - 1):.0%} of those steps ((P-1)/(m+P-1)), less as "
                     f"the batch grows ({(pp - 1) / (m + pp - 1):.0%} once a step has {m})")
    return tuple(notes)


def checkpoints_per_model_chunk(parallel, num_layers, recompute):
    """A note when --checkpoint-num-layers, which divides --num-layers, does not divide the
    layers of each pipeline stage's model chunk: there the last checkpoint is shorter."""
    pp = parallel.pipeline_model_parallel_size
    chunks = parallel.virtual_pipeline_model_parallel_size
    if pp == 1 or not recompute.checkpoint_activations:
        return ()
    per_stage, extra = divmod(num_layers, pp)
    sizes = {num_layers // (pp * chunks)} if chunks > 1 else {per_stage, per_stage + bool(extra)}
    units, what = (2, "layer halves") if recompute.split_transformers else (1, "layers")
    k = recompute.checkpoint_num_layers
    if all(size * units % k == 0 for size in sizes):
        return ()
    where = "model chunk" if chunks > 1 else "pipeline stage"
    counts = " or ".join(str(size * units) for size in sorted(sizes, reverse=True))
    return (f" note: --checkpoint-num-layers {k} does not divide the {counts} {what} of a "
            f"{where}: each {where} checkpoints {k} at a time and its last checkpoint holds "
            "the rest",)
