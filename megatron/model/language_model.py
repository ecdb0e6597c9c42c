"""Embeddings + transformer: the `language_model` sub-tree of Megatron's GPT-2."""

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.dropout import dropout
from megatron.model.transformer import ParallelTransformer


class Embedding(nn.Module):
    """Word embeddings (vocab-parallel) + learned position embeddings (replicated), dropout."""

    def __init__(self, config, init_method):
        super().__init__()
        self.word_embeddings = mpu.VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, init_method=init_method)
        # _weight skips nn.Embedding's own init, which would draw from the generator too.
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.hidden_size,
            _weight=torch.empty(config.max_position_embeddings, config.hidden_size,
                                dtype=torch.float32, device="cpu"))
        mpu.initialize_replicated_weight(self.position_embeddings.weight, init_method)
        self.embedding_dropout = config.hidden_dropout

    def forward(self, input_ids, position_ids):
        # input_ids, position_ids: [b, s] -> [b, s, h]
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        embeddings = dropout(embeddings, self.embedding_dropout, self.training)
        return embeddings


class TransformerLanguageModel(nn.Module):
    """Module tree (and state-dict keys) as Megatron-LM 1.1.5: embedding.*, transformer.*.

    Parameters are created in a fixed order, independent of the tensor- and pipeline-parallel
    sizes: word embeddings, position embeddings, then layer by layer (QKV, dense, h->4h, 4h->h).
    A pipeline stage keeps the embedding on the first stage only.
    """

    def __init__(self, config):
        super().__init__()
        init_method = mpu.init_method_normal(config.init_method_std)
        output_layer_init_method = mpu.scaled_init_method_normal(config.init_method_std,
                                                                 config.num_layers)
        embedding = Embedding(config, init_method)  # every stage draws its weights
        # under pipeline parallelism only the first stage keeps it
        self.embedding = embedding if mpu.is_pipeline_first_stage(ignore_virtual=True) \
            else None
        self.transformer = ParallelTransformer(config, init_method, output_layer_init_method)

    def forward(self, input_ids, position_ids, attention_mask=None, input_tensor=None, chunk=0):
        """input_tensor: the input of a pipeline stage (or model chunk) after the first, the
        previous one's output [b, s, h] (input_ids and position_ids are then unused)."""
        hidden_states = self.embedding(input_ids, position_ids) if input_tensor is None \
            else input_tensor
        return self.transformer(hidden_states, attention_mask, chunk)


def parallel_lm_logits(hidden_states, word_embeddings_weight, parallel_output):
    """Logits of the output layer tied to the input embedding.

    hidden_states [b, s, h] (replicated) x word_embeddings_weight [v/p, h] -> [b, s, v/p],
    or all-gathered to [b, s, v] when not parallel_output.
    """
    hidden_states = mpu.copy_to_model_parallel_region(hidden_states)
    logits_parallel = F.linear(hidden_states, word_embeddings_weight)
    if parallel_output:
        return logits_parallel
    return mpu.gather_from_model_parallel_region(logits_parallel)
