"""Worker side of the distributed GPT-2 tests: the same model at tensor-parallel size 2."""

import torch

from megatron import mpu
from megatron.model import GPT2Model, GPTConfig, get_ltor_masks_and_position_ids
from tests.mpu.cases import to_bytes

EOD = 0


def tiny_config(**overrides):
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                  max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**values, **overrides})


def batch():
    """[2, 12] tokens with eod (id 0) in the middle of each row, and next-token labels."""
    tokens = torch.randint(1, 64, (2, 13), generator=torch.Generator().manual_seed(5))
    tokens[0, 4] = tokens[1, 7] = tokens[1, 9] = EOD
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model, reset):
    tokens, labels = batch()
    mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=reset, reset_attention_mask=reset, eod_mask_loss=reset)
    losses = model(tokens, position_ids, mask, labels=labels)  # [b, s]
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    logits = model(tokens, position_ids, mask)
    return dict(losses=losses.detach(), grads=grads, logits=logits.detach())


def build_model(seed, **overrides):
    torch.manual_seed(seed)
    mpu.model_parallel_cuda_manual_seed(seed)
    return GPT2Model(tiny_config(**overrides), parallel_output=False)


def run_all(checkpoint_activations=False):
    """What the tests compare with a single process (there: tensor-parallel size 1)."""
    model = build_model(11, checkpoint_activations=checkpoint_activations)
    return dict(weights={k: v.clone() for k, v in model.state_dict().items()},
                plain=loss_and_grads(model, reset=False),
                reset=loss_and_grads(model, reset=True))


def dropout_checkpoint_grads(checkpoint_activations):
    """Grads with dropout on; the RNG streams restart identically for each call."""
    model = build_model(12, hidden_dropout=0.2, attention_dropout=0.2,
                        checkpoint_activations=checkpoint_activations)
    mpu.model_parallel_cuda_manual_seed(13)
    result = loss_and_grads(model, reset=True)
    model.eval()  # dropout off: the losses must differ, or the test proves nothing
    result["eval_losses"] = loss_and_grads(model, reset=True)["losses"]
    return result


def worker(rank, world_size):
    mpu.initialize_model_parallel(world_size)
    out = dict(run=run_all(), checkpointed=run_all(checkpoint_activations=True),
               dropout_plain=dropout_checkpoint_grads(False),
               dropout_checkpointed=dropout_checkpoint_grads(True))
    return to_bytes(out)
