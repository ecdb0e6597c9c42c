"""Left-to-right masks and positions for GPT-2 batches, and weight-decay parameter groups."""

import torch
from torch import nn


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask,
                                    eod_mask_loss):
    """(attention_mask, loss_mask, position_ids) for a batch of token ids `data` [b, s].

    attention_mask: None when documents may attend across eod tokens (then the model uses
        the fused causal path); with reset_attention_mask a bool [b, 1, s, s] mask, True =
        masked, that is causal and also stops tokens after an eod from seeing tokens up to
        and including it.
    loss_mask: float [b, s], 1.0 everywhere except at eod tokens when eod_mask_loss.
    position_ids: long [b, s], 0..s-1, or restarting at 0 after each eod when
        reset_position_ids.
    """
    batch, seq = data.shape
    device = data.device
    loss_mask = torch.ones(batch, seq, dtype=torch.float32, device=device)
    is_eod = data == eod_token  # [b, s]
    if eod_mask_loss:
        loss_mask.masked_fill_(is_eod, 0.0)

    positions = torch.arange(seq, dtype=torch.long, device=device)
    if reset_position_ids:
        # A document starts right after an eod: doc_start[b, j] = 1 + index of the last
        # eod before j (0 if none), found with a running max.
        after_eod = torch.zeros(batch, seq, dtype=torch.long, device=device)
        after_eod[:, 1:] = torch.where(is_eod[:, :-1], positions[1:], 0)
        doc_start = torch.cummax(after_eod, dim=1).values
        position_ids = positions - doc_start
    else:
        position_ids = positions.unsqueeze(0).expand(batch, seq)

    attention_mask = None
    if reset_attention_mask:
        # doc_index[b, j] = number of eods strictly before j; an eod belongs to the document
        # it ends.  Attend only backwards within the same document.
        doc_index = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()  # [b, s]
        same_doc = doc_index.unsqueeze(2) == doc_index.unsqueeze(1)  # [b, s(query), s(key)]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril_()
        attention_mask = ~(same_doc & causal).unsqueeze(1)  # [b, 1, s, s], True = masked
    return attention_mask, loss_mask, position_ids


def param_groups_for_weight_decay(model):
    """[{params: weights}, {params: biases and LayerNorm params, weight_decay: 0.0}]."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, nn.LayerNorm) or name == "bias":
                no_decay.append(param)
            else:
                decay.append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
