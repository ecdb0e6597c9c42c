"""Megatron GPT-2 <-> Hugging Face `GPT2LMHeadModel`: key map, tensor layouts and config.

Both sides are full (unsharded) state dicts.  The Megatron side uses the trainer's flat keys
with the word embeddings cut to the real vocabulary [vocab, h] (no padding); the HF side is
what `GPT2LMHeadModel.state_dict()` holds, minus the tied `lm_head.weight`.

Layouts that differ:
  * HF's Conv1D stores weights as [in, out]; Megatron's linears as [out, in]: transposed.
  * QKV: HF concatenates [Q | K | V] along the output, i.e. rows [3, np, hn]; Megatron
    (checkpoint version 2.0) orders them per head, [np, 3, hn], so that a column split gives
    each tensor-parallel rank whole heads.  Weight and bias are permuted alike.
  * The output layer is tied to wte on both sides; HF's lm_head.weight is not stored.
"""

import re

import torch

from megatron.errors import CheckpointError

# The tokenizer files of an HF folder, by tokenizer type: {model arg key: file name}.
HF_TOKENIZER_FILES = {
    "GPT2BPETokenizer": {"vocab_file": "vocab.json", "merge_file": "merges.txt"},
    "SentencePieceTokenizer": {"tokenizer_model": "tokenizer.model"},
}

# Megatron flat key -> HF key, for everything that is a plain copy or a transpose.
_GLOBAL_KEYS = {
    "language_model.embedding.word_embeddings.weight": "transformer.wte.weight",
    "language_model.embedding.position_embeddings.weight": "transformer.wpe.weight",
    "language_model.transformer.final_layernorm.weight": "transformer.ln_f.weight",
    "language_model.transformer.final_layernorm.bias": "transformer.ln_f.bias",
}
# Per layer: (Megatron suffix, HF suffix, how the tensor changes, HF shape: h the hidden size,
# f the MLP's)
_LAYER_KEYS = (
    ("input_layernorm.weight", "ln_1.weight", "copy", ("h",)),
    ("input_layernorm.bias", "ln_1.bias", "copy", ("h",)),
    ("attention.query_key_value.weight", "attn.c_attn.weight", "qkv_weight", ("h", "3h")),
    ("attention.query_key_value.bias", "attn.c_attn.bias", "qkv_bias", ("3h",)),
    ("attention.dense.weight", "attn.c_proj.weight", "transpose", ("h", "h")),
    ("attention.dense.bias", "attn.c_proj.bias", "copy", ("h",)),
    ("post_attention_layernorm.weight", "ln_2.weight", "copy", ("h",)),
    ("post_attention_layernorm.bias", "ln_2.bias", "copy", ("h",)),
    ("mlp.dense_h_to_4h.weight", "mlp.c_fc.weight", "transpose", ("h", "f")),
    ("mlp.dense_h_to_4h.bias", "mlp.c_fc.bias", "copy", ("f",)),
    ("mlp.dense_4h_to_h.weight", "mlp.c_proj.weight", "transpose", ("f", "h")),
    ("mlp.dense_4h_to_h.bias", "mlp.c_proj.bias", "copy", ("h",)),
)
# The global tensors' HF shapes (v: the vocab, p: the positions).
_GLOBAL_HF_SHAPES = {"transformer.wte.weight": ("v", "h"), "transformer.wpe.weight": ("p", "h"),
                     "transformer.ln_f.weight": ("h",), "transformer.ln_f.bias": ("h",)}
_MEGATRON_LAYER = "language_model.transformer.layers.{}."
_HF_LAYER = "transformer.h.{}."
# HF keys that are not weights: causal-mask buffers in older pytorch_model.bin files.
_HF_BUFFERS = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")
# Activations HF spells for the tanh GeLU our MLP computes.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def key_map(num_layers):
    """[(Megatron key, HF key, transform)] for a model of `num_layers` layers: plain data."""
    pairs = [(m, h, "copy") for m, h in _GLOBAL_KEYS.items()]
    for layer in range(num_layers):
        pairs += [(_MEGATRON_LAYER.format(layer) + m, _HF_LAYER.format(layer) + h, how)
                  for m, h, how, _ in _LAYER_KEYS]
    return pairs


def check_hf_shapes(hf_state_dict, args):
    """CheckpointError unless each HF weight has the shape the config (`args`, from
    model_args_from_hf_config) gives it: a config.json edited or copied from another model
    would otherwise convert into a checkpoint that no model loads."""
    hf_state_dict = _normalise_hf_keys(hf_state_dict)
    h, f = args["hidden_size"], args["ffn_hidden_size"]
    v, p = args["orig_vocab_size"], args["max_position_embeddings"]
    sizes = {"v": v, "h": h, "3h": 3 * h, "f": f, "p": p}
    expected = dict(_GLOBAL_HF_SHAPES)
    for layer in range(args["num_layers"]):
        expected.update({_HF_LAYER.format(layer) + suffix: shape
                         for _, suffix, _, shape in _LAYER_KEYS})
    for key, symbols in expected.items():
        tensor = hf_state_dict.get(key)
        if tensor is None:
            continue  # hf_to_megatron_state_dict names what is missing
        want = [sizes[symbol] for symbol in symbols]
        if list(tensor.shape) != want:
            raise CheckpointError(
                f"{key} is {list(tensor.shape)}, but config.json (vocab_size {v}, n_embd {h}, "
                f"n_inner {f}, n_positions {p}) makes it {want}: config.json and the weights "
                "do not match")


def _qkv_to_hf(tensor, num_heads):
    # rows [np, 3, hn] -> [3, np, hn]; a weight [3h, h] then becomes Conv1D's [h, 3h]
    rest = tensor.shape[1:]
    permuted = tensor.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(tensor.shape)
    return permuted.t() if tensor.dim() == 2 else permuted


def _qkv_from_hf(tensor, num_heads):
    tensor = tensor.t() if tensor.dim() == 2 else tensor  # [3h, h] or [3h], rows [3, np, hn]
    rest = tensor.shape[1:]
    return tensor.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def megatron_to_hf_state_dict(state_dict, num_layers, num_heads):
    """HF GPT2LMHeadModel weights (without the tied lm_head) from full Megatron weights."""
    out = {}
    for megatron_key, hf_key, how in key_map(num_layers):
        tensor = _require(state_dict, megatron_key, "Megatron")
        if how in ("qkv_weight", "qkv_bias"):
            tensor = _qkv_to_hf(tensor, num_heads)
        elif how == "transpose":
            tensor = tensor.t()
        out[hf_key] = tensor.contiguous()
    extra = sorted(set(state_dict) - {m for m, _, _ in key_map(num_layers)})
    if extra:
        raise CheckpointError(f"weights with no Hugging Face GPT-2 equivalent: {extra[:5]}")
    return out


def hf_to_megatron_state_dict(hf_state_dict, num_layers, num_heads):
    """Full Megatron weights (flat keys, word embeddings [vocab, h]) from HF GPT-2 weights.

    Accepts GPT2LMHeadModel keys ("transformer.h.0...") and GPT2Model keys ("h.0...").
    """
    hf_state_dict = _normalise_hf_keys(hf_state_dict)
    out = {}
    for megatron_key, hf_key, how in key_map(num_layers):
        tensor = _require(hf_state_dict, hf_key, "Hugging Face")
        if how in ("qkv_weight", "qkv_bias"):
            tensor = _qkv_from_hf(tensor, num_heads)
        elif how == "transpose":
            tensor = tensor.t()
        out[megatron_key] = tensor.contiguous()
    known = {h for _, h, _ in key_map(num_layers)} | {"lm_head.weight"}
    extra = sorted(k for k in set(hf_state_dict) - known if not _HF_BUFFERS.fullmatch(k))
    if extra:
        raise CheckpointError(f"the Hugging Face weights hold tensors a GPT-2 with {num_layers} "
                              f"layers does not have: {extra[:5]}; config.json and the weights "
                              "do not match")
    lm_head = hf_state_dict.get("lm_head.weight")
    if lm_head is not None and not torch.equal(lm_head, hf_state_dict["transformer.wte.weight"]):
        raise CheckpointError("lm_head.weight differs from transformer.wte.weight: this GPT-2 "
                              "does not tie its output layer to the input embedding, which "
                              "Megatron's GPT-2 requires")
    return out


def _normalise_hf_keys(hf_state_dict):
    if any(k.startswith("transformer.") for k in hf_state_dict):
        return hf_state_dict
    return {k if k == "lm_head.weight" else f"transformer.{k}": v
            for k, v in hf_state_dict.items()}


def _require(state_dict, key, side):
    if key not in state_dict:
        raise CheckpointError(f"the {side} weights have no {key!r}; the checkpoint is "
                              "incomplete or does not match its configuration")
    return state_dict[key]


# ------------------------------------------------------------------------------ config

def model_args_from_hf_config(config):
    """Megatron model args (dict) from a GPT-2 config.json dict; CheckpointError otherwise."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type != "gpt2":
        raise CheckpointError(
            f"config.json describes model_type {model_type!r} "
            f"({', '.join(architectures) or 'no architectures listed'}); only GPT-2 "
            "(model_type 'gpt2') converts to this trainer's model")
    activation = config.get("activation_function", "gelu_new")
    if activation not in _TANH_GELU:
        raise CheckpointError(f"config.json activation_function {activation!r}: this model's "
                              f"MLP computes the tanh GeLU ({', '.join(_TANH_GELU)})")
    unsupported = {key: config.get(key) for key, default in (
        ("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False)) if config.get(key, default) != default}
    if unsupported:
        raise CheckpointError(f"config.json sets {unsupported}, which this GPT-2 does not "
                              "implement")
    sizes = {key: config.get(key, default) for key, default in (
        ("n_layer", 12), ("n_embd", 768), ("n_head", 12), ("n_positions", 1024),
        ("vocab_size", 50257), ("n_inner", None))}  # n_inner None: 4 * n_embd
    bad = {key: value for key, value in sizes.items()
           if not (key == "n_inner" and value is None)
           and (isinstance(value, bool) or not isinstance(value, int) or value < 1)}
    if bad:
        raise CheckpointError(f"config.json sets {bad}: sizes must be positive integers")
    if sizes["n_embd"] % sizes["n_head"]:
        raise CheckpointError(f"config.json: n_head {sizes['n_head']} does not divide n_embd "
                              f"{sizes['n_embd']} ({sizes['n_embd']} % {sizes['n_head']} = "
                              f"{sizes['n_embd'] % sizes['n_head']})")
    return {
        "num_layers": sizes["n_layer"],
        "hidden_size": sizes["n_embd"],
        "num_attention_heads": sizes["n_head"],
        "ffn_hidden_size": sizes["n_inner"] or 4 * sizes["n_embd"],
        "max_position_embeddings": sizes["n_positions"],
        "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "orig_vocab_size": sizes["vocab_size"],
    }


def hf_config_from_model_args(args, eod_token_id=None):
    """config.json contents that GPT2LMHeadModel.from_pretrained reads (dropouts off: an
    inference/fine-tuning starting point; set them in the dict to train with them)."""
    hidden = args["hidden_size"]
    ffn = args.get("ffn_hidden_size") or 4 * hidden
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": args["orig_vocab_size"],
        "n_positions": args["max_position_embeddings"],
        "n_ctx": args["max_position_embeddings"],
        "n_embd": hidden,
        "n_layer": args["num_layers"],
        "n_head": args["num_attention_heads"],
        "n_inner": None if ffn == 4 * hidden else ffn,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": args.get("layernorm_epsilon", 1e-5),
        "initializer_range": args.get("init_method_std", 0.02),
        "resid_pdrop": args.get("hidden_dropout", 0.1),
        "embd_pdrop": args.get("hidden_dropout", 0.1),
        "attn_pdrop": args.get("attention_dropout", 0.1),
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if eod_token_id is not None:
        config["bos_token_id"] = config["eos_token_id"] = eod_token_id
    return config
