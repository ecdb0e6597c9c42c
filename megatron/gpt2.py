"""GPT-2 providers for `megatron.training.pretrain.pretrain`: model, datasets, batch and loss."""

import torch


def model_provider(ctx):
    from megatron.model import GPT2Model
    return GPT2Model(ctx.model_config, parallel_output=True)


def train_valid_test_datasets_provider(ctx, num_samples):
    from megatron.data.gpt2_dataset import (build_train_valid_test_datasets,
                                            indexed_datasets, require_training_documents)
    from megatron.data.token_range import check_token_ids
    from megatron.data.tokenization_record import check_dataset_tokenization
    data = ctx.config.data
    data_path = data.data_path
    if data.train_data is not None:
        from megatron.data.corpora import corpus_data_prefix
        data_path = corpus_data_prefix(data.train_data, ctx.tokenizer)
    train, valid, test = build_train_valid_test_datasets(
        data_path, data.split, num_samples, data.seq_length, ctx.config.parallel.seed,
        skip_warmup=not data.mmap_warmup, split_data_paths=data.split_data_paths)
    require_training_documents(train, data_path, data.split)
    if valid is None and ctx.config.training.eval_iters > 0 and data.split_data_paths is None:
        from megatron.data.rank_zero import log_rank_zero
        log_rank_zero(f" note: --split {data.split} leaves the valid split no documents (see "
                      f"the split line above): --eval-iters {ctx.config.training.eval_iters} "
                      "evaluates nothing and no validation loss is reported")
    checked = {}  # (the splits cut from --data-path share their datasets' .bin)
    for split in (train, valid, test):
        for indexed_dataset in indexed_datasets(split) if split is not None else ():
            checked.setdefault(indexed_dataset.prefix, indexed_dataset)
    for indexed_dataset in checked.values():
        check_dataset_tokenization(indexed_dataset, ctx.tokenizer)
        check_token_ids(indexed_dataset, ctx.model_config.vocab_size, ctx.tokenizer.vocab_size)
    return train, valid, test


def get_batch(batch, ctx):
    """tokens/labels shifted by one from the seq+1 sample, plus masks and positions."""
    from megatron.model import get_ltor_masks_and_position_ids
    flags = ctx.config.data
    data = batch["text"].to(ctx.runtime.device, non_blocking=True).long()  # [b, s+1]
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, ctx.tokenizer.eod, flags.reset_position_ids, flags.reset_attention_mask,
        flags.eod_mask_loss)
    return tokens, labels, loss_mask, attention_mask, position_ids


def forward_step(batch, model, ctx):
    """Mean cross entropy over the tokens the loss mask keeps; on a pipeline stage before the
    last, the stage's output hidden states (for the next stage)."""
    from megatron import mpu
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(batch, ctx)
    losses = model(tokens, position_ids, attention_mask, labels=labels)  # [b, s] fp32
    if not mpu.is_pipeline_last_stage():
        return losses  # hidden states [b, s, h]
    loss_mask = loss_mask.view(-1).float()
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum().clamp(min=1.0)
