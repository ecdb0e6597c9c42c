"""GPT-2 (Megatron-LM 1.1.5 layout): configuration, named sizes, parameter/FLOP counts, model."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from megatron import mpu
from megatron.errors import ConfigError
from megatron.model.language_model import TransformerLanguageModel, parallel_lm_logits
from megatron.model.shape import MODEL_SIZES, check_shape, require_divides
# Re-exported: the data pipeline and the optimizer find them next to the model.
from megatron.model.utils import (get_ltor_masks_and_position_ids,  # noqa: F401
                                  param_groups_for_weight_decay)  # noqa: F401

_PARAMS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # already padded (to a multiple of 128 * model_parallel_size)
    max_position_embeddings: int
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    # --split-transformers: attention and MLP halves are checkpointed separately (the chunks of
    # checkpoint_num_layers then count halves)
    split_transformers: bool = False
    # checkpoint(function, *args) for the chunks: None = mpu.checkpoint; zero.checkpointing's
    # under --deepspeed-activation-checkpointing (megatron/runtime/activation_checkpointing.py)
    checkpoint_function: Optional[Callable] = None
    params_dtype: torch.dtype = torch.float32
    # the transformer's linears as tile grids (megatron/model/tiling.py)
    memory_centric_tiled_linear: bool = False
    tile_factor: int = 1

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        self.validate(model_parallel_size=1)

    @classmethod
    def from_size(cls, name, vocab_size, max_position_embeddings, **overrides):
        """GPTConfig for a named size in MODEL_SIZES, e.g. "gpt2-124m"."""
        if name not in MODEL_SIZES:
            raise ConfigError(f"unknown model size {name!r}; known sizes: "
                              f"{', '.join(MODEL_SIZES)}")
        return cls(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                   **{**MODEL_SIZES[name], **overrides})

    def validate(self, model_parallel_size):
        """Raise ConfigError, with the arithmetic, if this model cannot be built at this TP."""
        check_shape(self, model_parallel_size)
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ConfigError(f"the vocab size must be a positive integer, got "
                              f"{self.vocab_size!r}")
        require_divides(model_parallel_size, "--model-parallel-size", self.vocab_size,
                        "the padded vocab size")
        if self.checkpoint_activations:
            require_divides(self.checkpoint_num_layers, "--checkpoint-num-layers",
                            self.num_layers, "--num-layers")
        if self.params_dtype not in _PARAMS_DTYPES:
            raise ConfigError(f"params_dtype must be one of {_PARAMS_DTYPES}, got "
                              f"{self.params_dtype}")


def pipeline_layer_slots(num_layers, layer_numbers, first_stage, last_stage):
    """[(layer index, state-dict prefix)] of a pipeline stage's layers in DeepSpeed's pipeline
    checkpoint (`layer_XX-model_YY-model_states.pt`): 0 the embeddings, 1 + n transformer
    layer n, num_layers + 1 the final LayerNorm; the prefix names the layer in the stage's
    model, whose transformer layers `layer_numbers` are numbered from 0."""
    slots = [(0, "language_model.embedding.")] if first_stage else []
    slots += [(1 + number, f"language_model.transformer.layers.{local}.")
              for local, number in enumerate(layer_numbers)]
    if last_stage:
        slots.append((1 + num_layers, "language_model.transformer.final_layernorm."))
    return slots


def check_pipeline_split(num_layers, pipeline_size):
    """ConfigError unless every one of `pipeline_size` stages gets at least one layer."""
    if isinstance(pipeline_size, bool) or not isinstance(pipeline_size, int) \
            or pipeline_size < 1:
        raise ConfigError(f"--pipeline-model-parallel-size must be a positive integer, got "
                          f"{pipeline_size!r}")
    if pipeline_size > num_layers:
        raise ConfigError(f"--pipeline-model-parallel-size {pipeline_size} is more stages than "
                          f"--num-layers {num_layers}: every stage needs at least one "
                          "transformer layer")


def num_parameters(config):
    """Total parameter count of the unsharded model (the output layer is tied, not counted)."""
    h, f, layers = config.hidden_size, config.ffn_hidden_size, config.num_layers
    per_layer = (2 * h                # input_layernorm
                 + 3 * h * h + 3 * h  # query_key_value
                 + h * h + h          # attention.dense
                 + 2 * h              # post_attention_layernorm
                 + h * f + f          # dense_h_to_4h
                 + f * h + h)         # dense_4h_to_h
    embeddings = (config.vocab_size + config.max_position_embeddings) * h
    return embeddings + layers * per_layer + 2 * h  # + final_layernorm


def flops_per_token(config, seq_length):
    """Training FLOPs per token (forward + backward = 3 x forward), for MFU.

        6 * N + 12 * L * h * s

    N = L * (4 h^2 + 2 h f) + V * h counts the weights used in matmuls: QKV, attention
    dense, both MLP projections and the (tied) output layer, each costing 2 FLOPs per weight
    per token forward.  The attention scores QK^T and the weighted sum of V cost 2 * 2 * s * h
    per layer per token forward (the causal half is counted in full, as Megatron does).
    Biases, LayerNorm, softmax and embedding lookups are left out.
    """
    h, f, layers = config.hidden_size, config.ffn_hidden_size, config.num_layers
    matmul_weights = layers * (4 * h * h + 2 * h * f) + config.vocab_size * h
    return 6 * matmul_weights + 12 * layers * h * seq_length


class GPT2Model(nn.Module):
    """GPT-2 with tensor parallelism; state-dict keys as Megatron-LM 1.1.5.

    forward(input_ids [b, s], position_ids [b, s], attention_mask=None, labels=None):
      * labels [b, s] given: per-token loss [b, s] in fp32 (mask and average it outside);
      * otherwise logits [b, s, v/p] (vocab-parallel) or, without parallel_output, [b, s, v].
    attention_mask None means plain causal attention (the fast path); a bool [b|1, 1, s, s]
    mask with True = masked comes from get_ltor_masks_and_position_ids(reset_attention_mask).
    """

    def __init__(self, config, parallel_output=True):
        super().__init__()
        config.validate(mpu.get_model_parallel_world_size())
        check_pipeline_split(config.num_layers, mpu.get_pipeline_model_parallel_world_size())
        self.config = config
        self.parallel_output = parallel_output
        self.pre_process = mpu.is_pipeline_first_stage(ignore_virtual=True)
        self.post_process = mpu.is_pipeline_last_stage(ignore_virtual=True)
        self.language_model = TransformerLanguageModel(config)
        if config.params_dtype != torch.float32:
            self.to(config.params_dtype)  # initialised in fp32 on CPU, then cast
        # Pipeline parallelism: the input of a stage after the first (set_input_tensor), and
        # on the last stage a copy of the first stage's word embeddings for the tied output
        # layer (megatron/pipeline/tied_embeddings.py keeps it in step; not a parameter).
        self._input_tensor = None
        self._compiled_loss = None  # compile(): the loss as one compiled graph, where it pays
        self.compiled_regions = None  # compile(): what it made compiled regions of, in words
        self.tied_head_weight = None

    def set_input_tensor(self, tensor):
        """What the next forward of a stage after the first starts from: the previous stage's
        output [b, s, h] (Megatron's set_input_tensor)."""
        self._input_tensor = tensor

    def _pipeline_layers(self):
        """{DeepSpeed pipeline layer index: module} of the layers this stage holds."""
        slots = pipeline_layer_slots(self.config.num_layers,
                                     self.language_model.transformer.layer_numbers,
                                     self.pre_process, self.post_process)
        return {index: self.get_submodule(prefix.rstrip(".")) for index, prefix in slots}

    def layer_state_dicts(self):
        """This stage's weights layer by layer, for DeepSpeed's pipeline checkpoint layout
        (`layer_XX-model_YY-model_states.pt`, zero/checkpoint/layout.py)."""
        return {index: module.state_dict() for index, module in self._pipeline_layers().items()}

    def load_layer_state_dicts(self, states, strict=True):
        """The inverse of layer_state_dicts(); returns (missing, unexpected) keys of all layers
        (what load_state_dict reports with strict=False), each named with its layer."""
        missing, unexpected = [], []
        for index, module in self._pipeline_layers().items():
            keys = module.load_state_dict(states[index], strict=strict)
            missing += [f"layer {index}: {key}" for key in keys.missing_keys]
            unexpected += [f"layer {index}: {key}" for key in keys.unexpected_keys]
        return missing, unexpected

    def output_layer_weight(self):
        """The word embeddings the output layer multiplies by: the parameter itself on the
        first stage, the tied copy on a last stage that does not hold it."""
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if self.tied_head_weight is None:
            raise RuntimeError("the last pipeline stage has no copy of the word embeddings; "
                               "megatron.pipeline.tied_embeddings must set it up first")
        return self.tied_head_weight

    def compile(self, *args, gradients_per_layer=False, **kwargs):
        """Regional compilation (torch.compile's arguments pass through), in place, so the
        state-dict keys stay: each transformer layer is compiled on its own, and since every
        layer runs the same code with its parameters as inputs, the compiled graphs serve them
        all (compile time does not grow with depth). That is one graph per layer; two around
        the eager attention of a layer with attention dropout at tensor-parallel size > 1 off
        the CPU (the RNG tracker). The tensor-parallel all-reduces are in the graph: dynamo
        traces them as functional collectives. Embeddings and the output layer stay eager (a
        lookup, one matmul).

        Off the CPU at tensor-parallel size 1 the loss is compiled too: fused, its passes over
        the [b, s, vocab] logits go from about eight to two. On the CPU mpu's cross entropy,
        which walks 16-bit logits in cache-sized chunks, is as fast. And on a lone GPU without
        recompute, where the training engine does not take `gradients_per_layer`
        (`compiles_whole_stack`), the stack of layers is one region instead: there a layer's
        kernels take less time than the host spends entering a compiled region and launching
        them, so per-layer regions leave the GPU waiting (docs/benchmarks.md). The zero
        engine passes `gradients_per_layer` (zero/compiler.py)."""
        on_cpu = next(self.parameters()).device.type == "cpu"
        if kwargs.get("fullgraph") and self.config.attention_dropout > 0 and not on_cpu \
                and mpu.get_model_parallel_world_size() > 1:
            raise ConfigError("torch.compile's fullgraph=True cannot compile this model's layers "
                              "whole: attention dropout off the CPU at tensor-parallel size > 1 "
                              "runs eagerly under the model-parallel RNG tracker. Drop fullgraph "
                              "from the compile kwargs")
        transformer = self.language_model.transformer
        if self.compiles_whole_stack(gradients_per_layer):
            transformer.compile(*args, **kwargs)
            self.compiled_regions = "the stack of layers as one region"
        else:
            for layer in transformer.layers:
                layer.compile(*args, **kwargs)
            self.compiled_regions = "each layer"
        if mpu.get_model_parallel_world_size() == 1 and not on_cpu:
            self._compiled_loss = torch.compile(_full_vocabulary_cross_entropy, *args, **kwargs)

    def compiles_whole_stack(self, gradients_per_layer=False):
        """Whether compile() makes the whole stack of layers one region (traced layer by
        layer, so compile time grows with depth). It does when all of these hold:

        - off the CPU (there a layer's work takes far longer than entering its region, so
          regions per layer, sharing one compile, cost nothing);
        - tensor-, pipeline- and data-parallel size 1: no data-parallel bucket waits to go
          while earlier layers still run backward; one region for several tensor-parallel
          ranks or pipeline stages has not been measured (and at tensor-parallel size > 1
          attention dropout off the CPU breaks the graph anyway);
        - not `gradients_per_layer`: the training engine frees or offloads each layer's
          gradients during backward (ZeRO stage 2, optimizer offload), where one region hands
          them all out at its end;
        - no activation checkpointing, whose recompute runs per layer, outside the graph."""
        return (next(self.parameters()).device.type != "cpu"
                and mpu.get_model_parallel_world_size() == 1
                and mpu.get_pipeline_model_parallel_world_size() == 1
                and mpu.get_data_parallel_world_size() == 1
                and not gradients_per_layer
                and not self.config.checkpoint_activations)

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None):
        """Under pipeline parallelism a stage before the last returns its hidden states
        [b, s, h]; a stage after the first starts from the tensor set_input_tensor gave. With
        the interleaved schedule the same holds per model chunk: the chunk at work is mpu's
        virtual pipeline rank."""
        input_tensor, self._input_tensor = self._input_tensor, None
        chunk = mpu.get_virtual_pipeline_model_parallel_rank() or 0
        first_here = self.pre_process and chunk == 0
        last_here = self.post_process and \
            chunk == len(self.language_model.transformer.chunk_layers) - 1
        if not first_here and input_tensor is None:
            raise RuntimeError("a pipeline stage (or model chunk) after the first needs "
                               "set_input_tensor() before its forward")
        hidden_states = self.language_model(input_ids, position_ids, attention_mask,
                                            input_tensor=None if first_here else input_tensor,
                                            chunk=chunk)
        if not last_here:
            return hidden_states
        word_embeddings_weight = self.output_layer_weight()
        if labels is not None:
            logits = parallel_lm_logits(hidden_states, word_embeddings_weight, True)
            loss = self._compiled_loss or mpu.vocab_parallel_cross_entropy
            return loss(logits, labels)  # [b, s] fp32
        return parallel_lm_logits(hidden_states, word_embeddings_weight, self.parallel_output)


def _full_vocabulary_cross_entropy(logits, labels):
    """Per-token loss in fp32, shaped like `labels`, from logits over the whole vocabulary
    (tensor-parallel size 1): what mpu.vocab_parallel_cross_entropy computes there for
    labels in [0, vocab), the only ones the data pipeline makes (F.cross_entropy gives -100
    a zero loss and fails on other labels outside the vocabulary)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                                             reduction="none").view(labels.shape)
