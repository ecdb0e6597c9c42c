"""The rules a GPT-2 shape must satisfy, without torch: the named sizes, and the checks (with
the arithmetic in the message) that the trainer's config runs before anything is imported or
built, and that the model's own config runs again on construction."""

from megatron.errors import ConfigError

# Architecture of the named sizes; vocab and sequence length come from tokenizer and flags.
MODEL_SIZES = {
    "gpt2-tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4),
    "gpt2-small-test": dict(num_layers=4, hidden_size=128, num_attention_heads=4),
    "gpt2-124m": dict(num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-345m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "gpt2-774m": dict(num_layers=36, hidden_size=1280, num_attention_heads=20),
    "gpt2-1.5b": dict(num_layers=48, hidden_size=1600, num_attention_heads=25),
}


def check_shape(model, model_parallel_size):
    """ConfigError, with the arithmetic, unless the architecture fields of `model` (a GPTConfig
    or the trainer's model config: num_layers, hidden_size, num_attention_heads,
    ffn_hidden_size, max_position_embeddings, the dropouts, the tiling) can be built at this
    tensor-parallel size."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "max_position_embeddings"):
        value = getattr(model, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                              f"got {value!r}")
    if isinstance(model_parallel_size, bool) or not isinstance(model_parallel_size, int) \
            or model_parallel_size < 1:
        raise ConfigError(f"--model-parallel-size must be a positive integer, got "
                          f"{model_parallel_size!r}")
    require_divides(model.num_attention_heads, "--num-attention-heads", model.hidden_size,
                    "--hidden-size")
    # (--ffn-hidden-size's default, 4 x hidden, is divisible whenever the heads are)
    for value, flag in ((model.num_attention_heads, "--num-attention-heads"),
                        (model.ffn_hidden_size, "--ffn-hidden-size")):
        require_divides(model_parallel_size, "--model-parallel-size", value, flag)
    if model.memory_centric_tiled_linear:
        check_tile_factor(model.tile_factor, model.hidden_size, model.ffn_hidden_size,
                          model_parallel_size)
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(model, name)
        if not 0.0 <= value < 1.0:  # False for NaN too
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")


def check_tile_factor(tile_factor, hidden_size, ffn_hidden_size, model_parallel_size):
    """ConfigError, with the arithmetic, if a tile grid does not divide a layer's local shard."""
    if not isinstance(tile_factor, int) or tile_factor < 1:
        raise ConfigError(f"--tile-factor must be a positive integer, got {tile_factor!r}")
    f, p = tile_factor, model_parallel_size
    # (what is split, its size on one tensor-parallel rank, number of tiles along it)
    dims = [("--hidden-size (input of QKV and h->4h, output of dense and 4h->h)",
             hidden_size, f),
            ("QKV output 3 * hidden / model-parallel-size", 3 * hidden_size // p, 3 * f),
            ("dense input hidden / model-parallel-size", hidden_size // p, f),
            ("h->4h output ffn-hidden / model-parallel-size", ffn_hidden_size // p, 4 * f),
            ("4h->h input ffn-hidden / model-parallel-size", ffn_hidden_size // p, 4 * f)]
    for what, size, tiles in dims:
        if size % tiles != 0:
            raise ConfigError(f"--tile-factor {f} does not divide the layers: {what} = {size} "
                              f"is not divisible by {tiles} tiles ({size} % {tiles} = "
                              f"{size % tiles}); choose a tile factor that divides it")


def require_divides(divisor, divisor_name, value, value_name):
    if divisor < 1 or value % divisor != 0:
        raise ConfigError(f"{divisor_name} {divisor} must divide {value_name} {value} "
                          f"({value} % {divisor} = {value % max(divisor, 1)})")
