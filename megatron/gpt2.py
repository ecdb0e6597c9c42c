"""GPT-2 providers for `megatron.training.pretrain.pretrain`: model, datasets, batch and loss."""

import torch

from megatron import mpu
from megatron.errors import ConfigError


def model_provider(ctx):
    from megatron.runtime.activation_checkpointing import checkpoint_function
    from megatron.model import GPT2Model, GPTConfig
    args = ctx.args
    config = GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon,
        checkpoint_activations=args.checkpoint_activations,
        checkpoint_num_layers=args.checkpoint_num_layers,
        split_transformers=getattr(args, "split_transformers", False),
        checkpoint_function=checkpoint_function(args),
        memory_centric_tiled_linear=getattr(args, "memory_centric_tiled_linear", False),
        tile_factor=getattr(args, "tile_factor", None) or 1)
    return GPT2Model(config, parallel_output=True)


def train_valid_test_datasets_provider(ctx, num_samples):
    from megatron.data.gpt2_dataset import build_train_valid_test_datasets
    args = ctx.args
    data_prefix = args.data_path
    if args.train_data is not None:
        from megatron.data.corpora import prepare_loose_json_corpus, resolve_corpus
        data_prefix = prepare_loose_json_corpus(resolve_corpus(args.train_data), ctx.tokenizer)
    train, valid, test = build_train_valid_test_datasets(
        data_prefix, args.split, num_samples, args.seq_length, args.seed,
        skip_warmup=not args.mmap_warmup)
    if train is None:
        raise ConfigError(f"--split {args.split!r} leaves no training documents in "
                          f"{data_prefix}; give the first split a positive weight")
    return train, valid, test


def get_batch(batch, ctx):
    """tokens/labels shifted by one from the seq+1 sample, plus masks and positions."""
    from megatron.model import get_ltor_masks_and_position_ids
    args = ctx.args
    data = batch["text"].to(ctx.runtime.device, non_blocking=True).long()  # [b, s+1]
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, ctx.tokenizer.eod, args.reset_position_ids, args.reset_attention_mask,
        args.eod_mask_loss)
    return tokens, labels, loss_mask, attention_mask, position_ids


def forward_step(batch, model, ctx):
    """Mean cross entropy over the tokens the loss mask keeps."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(batch, ctx)
    losses = model(tokens, position_ids, attention_mask, labels=labels)  # [b, s] fp32
    loss_mask = loss_mask.view(-1).float()
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum().clamp(min=1.0)
