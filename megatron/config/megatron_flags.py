"""Megatron-LM flags that are not flags of this trainer, each with what to do instead: a
ported command line gets one error naming them all, not argparse's "unrecognized arguments".
They come from Megatron-LM 1.1.5 (DeepSpeed's fork), later Megatron-LM (whose renamed flags,
such as --micro-batch-size, are aliases in flags.py), Megatron-DeepSpeed (Microsoft's fork,
whose example scripts carry its MoE, sequence-parallel, data-efficiency and distillation
flags), and from the earlier Megatron-LM of DeepSpeed's GPT-2 tutorial (DeepSpeedExamples'
`Megatron-LM/`, whose `--train-data webtext` this trainer takes). Some ask for what this
trainer always does; those are taken and said once at start-up. A choice flag's value that
another Megatron-LM offers and this trainer does not is answered the same way (`offered_here`).
"""

import argparse

from megatron.errors import ConfigError

_FUSED_ATTENTION = ("attention is torch's scaled_dot_product_attention wherever torch has a "
                    "fused kernel for it; on a CPU with attention dropout it is a few passes "
                    "(scale and mask inside the q·kᵀ product, then softmax and dropout), "
                    "which --compile fuses")
_FP32_SCORES = ("an fp16 guard for Megatron's own attention kernel; here the scale is applied "
                "inside the q·kᵀ product and the softmax accumulates in fp32 (on a CPU, "
                "prefer --bf16)")
_OLD_LOADERS = ("a data loader of the tutorial's Megatron-LM that is not built: tokenize with "
                "tools/preprocess_data.py and give --data-path, or give a loose-JSON corpus "
                "(a \"text\" key per line) as --train-data")
_OLD_TOKENIZER = ("the tutorial's Megatron-LM downloaded GPT-2's tokenizer files; nothing is "
                  "downloaded here: give --tokenizer-type GPT2BPETokenizer --vocab-file "
                  "vocab.json --merge-file merges.txt (python tools/train_tokenizer.py makes "
                  "them), or --tokenizer-type SentencePieceTokenizer --tokenizer-model FILE")
_OLD_EVAL_DATA = ("validation and test data are --split's shares of the training data; "
                  "tools/evaluate_gpt2.py scores a checkpoint on another corpus")
_AUTORESUME = ("NVIDIA's cluster autoresume is not built: --exit-signal-handler saves and "
               "exits on SIGTERM, --exit-duration-in-mins before the allocation ends, and "
               "--load resumes")
_OTHER_MODELS = ("a later Megatron-LM model option (rotary or ALiBi positions, SwiGLU, RMSNorm, "
                 "grouped-query attention, untied or bias-free layers, mixture of experts); "
                 "this trainer builds GPT-2: learned positions, GeLU MLP, LayerNorm, biases, "
                 "tied embeddings")
_FP8 = "fp8 training (Transformer Engine) is not built: use --bf16 or --fp16"
_RECOMPUTE = ("full-layer recompute is --checkpoint-activations --checkpoint-num-layers N here "
              "(Megatron's --recompute-granularity full --recompute-method uniform "
              "--recompute-num-layers N); selective and block recompute are not built")
_WANDB = ("Weights & Biases logging is not built: metrics.jsonl (--log-dir) and TensorBoard "
          "(--tensorboard-dir) have the numbers")
_NO_FUSED_KERNELS = ("none of Megatron's fused CUDA kernels is used: attention is torch's "
                     "scaled_dot_product_attention, and --compile fuses the elementwise work")
_PROFILE_STEPS = ("Megatron-DeepSpeed's steps S,E count from this run's start; here "
                  "--profile-step-start and --profile-step-end are iteration numbers, as the log "
                  "line counts them: S,E of a run that starts at iteration K is "
                  "--profile-step-start K+S-1 --profile-step-end K+E")
_MOE = ("Megatron-DeepSpeed's mixture of experts (DeepSpeed-MoE) is not built: each layer has "
        "one dense GeLU MLP; drop the MoE flags")
_ULYSSES = ("DeepSpeed-Ulysses sequence parallelism is not built: each rank runs the whole "
            "--seq-length, so the ranks it would use are data-parallel ranks here")
_DATA_EFFICIENCY = ("DeepSpeed's data-efficiency library (curriculum sampling, random "
                    "layer-token drop, analysis indices) is not built: samples come in the "
                    "index maps' shuffled order at full --seq-length, every layer sees every "
                    "token; drop the flag and the config's data_efficiency section")
_DISTILLATION = ("knowledge distillation (a teacher model in the loss) is not built: the loss "
                 "is GPT-2's cross-entropy on the data; drop the teacher flags")
_INFERENCE = ("pretrain_gpt2.py has no inference mode: tools/generate_samples.py generates "
              "from a checkpoint and tools/evaluate_gpt2.py scores one")

# flag -> why it is not taken and what to do instead
NOT_TAKEN = {
    "--num-unique-layers": "sharing weights between layers is not built; every layer has its "
                           "own",
    "--param-sharing-style": "sharing weights between layers is not built; every layer has its "
                             "own",
    "--apply-residual-connection-post-layernorm": "the model is GPT-2's pre-LayerNorm block; "
                                                  "the post-LayerNorm residual is not built",
    "--onnx-safe": "the MLP's GeLU is GPT-2's tanh form; the erf form for ONNX export is not "
                   "built",
    "--scaled-upper-triang-masked-softmax-fusion": _FUSED_ATTENTION,
    "--scaled-masked-softmax-fusion": _FUSED_ATTENTION,
    "--bias-gelu-fusion": "Megatron's TorchScript fusion; --compile fuses each layer's bias, "
                          "GeLU, dropout and residual add",
    "--bias-dropout-fusion": "Megatron's TorchScript fusion; --compile fuses each layer's "
                             "bias, GeLU, dropout and residual add",
    "--apply-query-key-layer-scaling": _FP32_SCORES,
    "--fp16-lm-cross-entropy": "the loss is computed in fp32 from 16-bit logits (on a CPU in "
                               "chunks, without an fp32 copy of them); an fp16 loss is not "
                               "built",
    "--lazy-mpu-init": "process groups started by an outside framework are not built; torchrun "
                       "or the launcher's variables start every rank",
    "--scattered-embeddings": "scattering the embedding and attention outputs over tensor-"
                              "parallel ranks is not built (--partition-activations splits the "
                              "checkpointed activations)",
    "--mask-prob": "a BERT flag; this trainer trains GPT-2",
    "--short-seq-prob": "a BERT flag; this trainer trains GPT-2",
    "--adlr-autoresume": _AUTORESUME,
    "--adlr-autoresume-interval": _AUTORESUME,
    # DeepSpeed's GPT-2 tutorial (the earlier Megatron-LM's arguments)
    "--cache-dir": _OLD_TOKENIZER,
    "--tokenizer-path": _OLD_TOKENIZER,
    "--tokenizer-model-type": _OLD_TOKENIZER,
    "--text-key": "--train-data reads each line's \"text\"; for another key tokenize with "
                  "tools/preprocess_data.py --json-keys KEY and give --data-path",
    "--eval-text-key": _OLD_EVAL_DATA,
    "--valid-data": _OLD_EVAL_DATA,
    "--test-data": _OLD_EVAL_DATA,
    "--eval-batch-size": "validation uses the training batch size (--batch-size)",
    "--eval-seq-length": "validation uses the training --seq-length",
    "--presplit-sentences": "a BERT flag; this trainer trains GPT-2",
    "--max-preds-per-seq": "a BERT flag; this trainer trains GPT-2",
    "--eval-max-preds-per-seq": "a BERT flag; this trainer trains GPT-2",
    "--delim": _OLD_LOADERS,
    "--use-npy-data-loader": _OLD_LOADERS,
    "--val-data-path": _OLD_LOADERS,
    "--input-data-sizes-file": _OLD_LOADERS,
    "--use-tfrecords": _OLD_LOADERS,
    # later Megatron-LM's models, parallelism and kernels
    **{flag: _OTHER_MODELS for flag in (
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--group-query-attention", "--num-query-groups", "--num-key-value-heads",
        "--use-rotary-position-embeddings", "--rotary-percent", "--rotary-base",
        "--rope-theta", "--no-position-embedding", "--apply-layernorm-1p", "--embed-layernorm",
        "--expert-model-parallel-size", "--moe-router-topk",
        "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-grouped-gemm",
        "--moe-token-dispatcher-type")},
    "--use-mcore-models": "Megatron-core's model classes are not built: the model is this "
                          "trainer's GPT-2 (Megatron-LM 1.1.5's state-dict layout)",
    "--transformer-impl": "Megatron-core's transformer implementations are not built: the model "
                          "is this trainer's GPT-2",
    "--attention-backend": "attention is torch's scaled_dot_product_attention, which picks its "
                           "own kernel",
    **{flag: _FP8 for flag in ("--fp8-format", "--fp8-margin", "--fp8-amax-history-len",
                               "--fp8-amax-compute-algo", "--fp8-param-gather",
                               "--no-fp8-wgrad")},
    "--sequence-parallel": "Megatron's sequence parallelism is not built: LayerNorm and dropout "
                           "run whole on each tensor-parallel rank (--partition-activations "
                           "splits the checkpointed activations)",
    "--context-parallel-size": "context parallelism is not built: each rank runs the whole "
                               "--seq-length",
    "--use-distributed-optimizer": "Megatron's distributed optimizer is ZeRO stage 1 here: "
                                   "--deepspeed --deepspeed_config scripts/ds_zero_stage_1.config "
                                   "partitions the optimizer states over data parallelism",
    "--overlap-param-gather": "overlapping the parameter all-gather with forward is not built "
                              "(ZeRO stages 1-2 all-gather the updated parameters after the "
                              "step)",
    "--grad-reduce-in-bf16": "gradients are reduced in the parameters' dtype: bf16 under --bf16 "
                             "(--fp32-allreduce for fp32)",
    "--recompute-activations": "Megatron's selective recompute (attention only) is not built: "
                               "--checkpoint-activations recomputes whole layers",
    **{flag: _RECOMPUTE for flag in ("--recompute-granularity", "--recompute-method",
                                     "--recompute-num-layers", "--activations-checkpoint-method",
                                     "--activations-checkpoint-num-layers")},
    "--cross-entropy-loss-fusion": "the loss is computed vocab-parallel in fp32 (in chunks on a "
                                   "CPU); Megatron's fused kernel is not built",
    "--calculate-per-token-loss": "the loss is the mean over the global batch's tokens",
    "--decoupled-lr": "a separate learning rate for the embeddings is not built",
    "--decoupled-min-lr": "a separate learning rate for the embeddings is not built",
    "--use-z-loss": "z-loss is not built",
    **{flag: _WANDB for flag in ("--wandb-project", "--wandb-entity", "--wandb-name",
                                 "--wandb-exp-name", "--wandb-save-dir")},
    "--vocab-size": "the vocabulary is the tokenizer's (--vocab-file/--merge-file or "
                    "--tokenizer-model), padded by --make-vocab-size-divisible-by",
    "--tokenizer-name-or-path": "Hugging Face tokenizers are not loaded: --tokenizer-type "
                                "GPT2BPETokenizer with --vocab-file/--merge-file, or "
                                "SentencePieceTokenizer with --tokenizer-model",
    "--ckpt-format": "checkpoints are Megatron-LM 1.1.5's layout (DeepSpeed's under "
                     "--deepspeed); tools/convert_checkpoint.py converts to Hugging Face's",
    "--data-cache-path": "the index maps are written next to the dataset "
                         "(tools/build_index_maps.py builds them before a run)",
    "--no-mmap-bin-files": "the .bin is always memory-mapped",
    "--use-mpi": "--deepspeed_mpi takes rank and world size from mpirun",
    # Megatron-DeepSpeed's own
    **{flag: "the zero-bubble (ZB-H1) pipeline schedule is not built: stages run 1F1B; "
             "--num-layers-per-virtual-pipeline-stage interleaves them, which shrinks the "
             "bubble" for flag in ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics")},
    **{flag: _ULYSSES for flag in ("--force-ds-sequence-parallel", "--ds-sequence-parallel-fpdt",
                                   "--ds-sequence-parallel-fpdt-chunk-size",
                                   "--ds-sequence-parallel-fpdt-offloading")},
    **{flag: _MOE for flag in ("--num-experts-switch", "--num-experts-teacher")},
    "--rotary-position-embeddings-theta": _OTHER_MODELS,
    **{flag: _DATA_EFFICIENCY for flag in (
        "--random-ltd", "--data-efficiency-curriculum-learning", "--train-idx-path",
        "--train-desc-path", "--train-doc-idx-path", "--train-sample-idx-path",
        "--train-shuffle-idx-path", "--train-data-exact-num-epochs", "--return-data-index")},
    **{flag: _DISTILLATION for flag in (
        "--kd", "--mos", "--kd-alpha-ce", "--kd-beta-ce", "--kd-temp", "--num-layers-teacher",
        "--hidden-size-teacher", "--num-attention-heads-teacher", "--load-teacher")},
    **{flag: _INFERENCE for flag in ("--inference", "--ds-inference")},
    "--use-dataset-only": "using the data pipeline alone is megatron.data's Python API, not a "
                          "pretrain_gpt2.py mode",
    "--aml-data-download-path": "AzureML mounts are not looked up: give the mounted dataset's "
                                "prefix as --data-path",
    "--no-load-lr-state": "the schedule's state resumes with the optimizer's: "
                          "--override-lr-scheduler takes the schedule from the flags, "
                          "--no-load-optim starts both afresh",
    "--reset-iteration": "restarting the iteration count with the optimizer state kept is not "
                         "built: --finetune loads the weights and starts at iteration 0 with "
                         "a fresh optimizer",
    "--profile_steps": _PROFILE_STEPS,
    "--kill-switch-path": "the BigScience fork's spelling: --kill-switch-file PATH (Megatron-"
                          "DeepSpeed's) saves and exits once the file exists",
    "--trust-remote-code": "Hugging Face tokenizers are not loaded: --tokenizer-type "
                           "GPT2BPETokenizer with --vocab-file/--merge-file, or "
                           "SentencePieceTokenizer with --tokenizer-model",
}

# flag -> what this trainer always does, which the flag asks for
ALWAYS_SO = {
    "--openai-gelu": "the MLP's GeLU is always GPT-2's tanh form",
    "--use-cpu-initialization": "weights are always initialised on the CPU from the seeded "
                                "generator, as for the whole tensor, each rank keeping its "
                                "part",
    "--resume-dataloader": "a resume always continues the data at the checkpoint's count of "
                           "consumed samples",
    "--lazy-loader": "the tokenized .bin is always memory-mapped and read as samples are "
                     "drawn",
    "--loose-json": "--train-data FILE.json is always read as loose JSON (one object a line)",
    "--shuffle": "the training samples are always shuffled, by --seed",
    "--log-validation-ppl-to-tensorboard": "each evaluation's perplexity always goes to "
                                           "TensorBoard (lm-loss-valid-ppl)",
    "--attention-softmax-in-fp32": "the attention softmax always accumulates in fp32 (torch's "
                                   "scaled_dot_product_attention)",
    "--use-flash-attn": "attention is torch's scaled_dot_product_attention, which runs a "
                        "flash-attention kernel where torch has one for the device and dtype",
    "--overlap-grad-reduce": "the data-parallel gradient reduction always overlaps backward: "
                             "each full bucket is reduced as soon as backward fills it",
    "--log-throughput": "the log line always has tokens/s and MFU",
    "--use-checkpoint-args": "model flags left out are always taken from --load's checkpoint "
                             "(a note lists them); a model flag given must match it",
    "--use-pytorch-profiler": "--profile always runs torch.profiler (Megatron-LM's ranges for "
                              "Nsight Systems, its default without this flag, are not built: "
                              "run the job under nsys to see its GPU timeline)",
    "--no-create-attention-mask-in-dataloader": "the data loader builds no attention mask "
                                                "unless --reset-attention-mask asks for one",
    **{flag: _NO_FUSED_KERNELS for flag in (
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion", "--no-persist-layer-norm")},
    "--no-query-key-layer-scaling": "query-key layer scaling is not applied",
    "--no-async-tensor-model-parallel-allreduce": "the tensor-parallel all-reduce of the input "
                                                  "gradient is not overlapped with the weight "
                                                  "gradient",
    # Megatron-DeepSpeed's own
    "--no-pipeline-parallel": "at --pipeline-model-parallel-size 1 the model is never a "
                              "pipeline: the engine has no pipeline stages and checkpoints "
                              "hold the whole module, as Megatron-DeepSpeed's do with this flag",
    **{flag: "attention is torch's scaled_dot_product_attention, which runs a flash-attention "
             "kernel where torch has one for the device and dtype"
       for flag in ("--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
                    "--use-flash-attn-builder")},
    "--disable-mem-efficient-ln": "LayerNorm is torch's nn.LayerNorm; apex's memory-efficient "
                                  "LayerNorm is never used",
    "--ds_fused_adam": "the Adam step is torch.optim.AdamW's fused or foreach kernel, the update "
                       "DeepSpeed's FusedAdam makes in its AdamW mode",
    "--repeated-dataloader": "the training samples span as many epochs of the data as the run "
                             "needs, so the loader never runs dry",
    "--universal-checkpoint": "--load resumes the checkpoint `latest` names as it is, at any "
                              "data-parallel size and ZeRO stage (3 <-> 0-2); DeepSpeed's "
                              "universal folders (ds_to_universal.py) are not read",
    **{flag: "no effect in a dense model (as in Megatron-DeepSpeed with --num-experts 1)"
       for flag in ("--create-moe-param-group", "--disable-moe-token-dropping",
                    "--disable-moe-top2-2nd-expert-sampling", "--use-tutel",
                    "--enable-expert-tensor-parallelism")},
}

# Megatron-DeepSpeed flags with a value that do nothing in the dense model this trainer builds
# (as in Megatron-DeepSpeed with --num-experts 1): taken with a note -> their type
DENSE_MODEL_FLAGS = {"--moe-expert-parallel-size": int, "--moe-loss-coeff": float,
                     "--moe-train-capacity-factor": float, "--moe-eval-capacity-factor": float,
                     "--moe-min-capacity": int, "--topk": int, "--expert-interval": int,
                     "--mlp-type": str}


def offered_here(other_values, convert=str):
    """The type of a choice flag: a value that another Megatron-LM offers and this trainer does
    not is refused with what to give instead, where argparse's "invalid choice" would only
    list the choices; any other value goes on to argparse's own checks."""
    def parse(text):
        if text in other_values:
            raise argparse.ArgumentTypeError(f"{text}: {other_values[text]}")
        return convert(text)
    parse.__name__ = convert.__name__  # argparse's "invalid int value: 'x'" names it
    return parse


def refuse_flags_not_taken(argv, parser):
    """ConfigError naming every NOT_TAKEN flag in `argv` (`--flag` or `--flag=value`) that
    `parser` does not define (a script's extra_args_provider may add one of them)."""
    defined = {s for action in parser._actions for s in action.option_strings}
    given = [flag for flag in NOT_TAKEN if flag not in defined
             and any(arg == flag or arg.startswith(flag + "=") for arg in argv)]
    if given:
        by_reason = {}  # flags with the same reason named together, the reason said once
        for flag in given:
            by_reason.setdefault(NOT_TAKEN[flag], []).append(flag)
        reasons = "; ".join(f"{', '.join(flags)}: {why}" for why, flags in by_reason.items())
        raise ConfigError(f"Megatron-LM flag{'s' if len(given) > 1 else ''} not taken here "
                          f"(drop {'them' if len(given) > 1 else 'it'}): {reasons}")


def add_always_so_flags(parser):
    group = parser.add_argument_group("Megatron-LM flags for what this trainer always does")
    for flag, what in ALWAYS_SO.items():
        group.add_argument(flag, action="store_true", help=f"accepted: {what}")


def add_dense_model_flags(parser):
    group = parser.add_argument_group("Megatron-DeepSpeed MoE flags, which do nothing in a "
                                      "dense model")
    for flag, kind in DENSE_MODEL_FLAGS.items():
        group.add_argument(flag, type=kind, default=None, help="accepted: no effect")
    group.add_argument("--num-experts", type=_one_expert, nargs="+", default=None,
                       help="1: a dense model, the only one built here")
    group.add_argument("--ds-sequence-parallel-size", type=_one_sequence_rank, default=None,
                       help="1: off, the only value taken here")


def _one_expert(text):
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(f"{text}: {_MOE}")
    return 1


def _one_sequence_rank(text):
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(f"{text}: {_ULYSSES}")
    return 1


def always_so_notes(raw):
    """One note per ALWAYS_SO flag given (its dest set in the parsed `raw`), and per
    DENSE_MODEL_FLAGS flag."""
    always = {**ALWAYS_SO,
              "--num-experts": "the model is dense, one GeLU MLP per layer",
              "--ds-sequence-parallel-size": "each rank runs the whole --seq-length"}
    return tuple(f" note: {flag} asks for what this trainer always does: {what}"
                 for flag, what in always.items() if raw.get(_dest(flag))) + tuple(
        f" note: {flag} {raw[_dest(flag)]} has no effect in a dense model (as in "
        "Megatron-DeepSpeed with --num-experts 1)"
        for flag in DENSE_MODEL_FLAGS if raw.get(_dest(flag)) is not None)


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")
