"""Real DeepSpeed's PipelineEngine on a model shaped and named as Megatron-DeepSpeed's
GPTModelPipe (its list: a cast, the embeddings tied to the output layer, the transformer
layers, the final LayerNorm, the tied output layer), for benchmarks/deepspeed_compat.py.

Runs inside the DeepSpeed venv (torch and deepspeed only), one process per pipeline stage,
started by deepspeed_venv.launch_ranks:
    megatron_deepspeed_pipe_task.py <out_dir> <steps> <fp32|bf16>
Trains at ZeRO-1 (bf16: DeepSpeed's BF16_Optimizer, as Megatron-DeepSpeed's bf16 runs) and
saves to <out_dir>/ckpt; each rank writes the fp32 master and Adam moments its optimizer holds
for each of its parameters (by the PipelineModule's names) to <out_dir>/live_optimizer_rank<r>.pt.
"""

import os
import sys

import torch
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, SEQ, LAYERS = 64, 32, 4, 8, 4


class Embedding(torch.nn.Module):  # Megatron-DeepSpeed's EmbeddingPipe: its two tables
    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = torch.nn.Embedding(SEQ, HIDDEN)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, tokens):
        return self.word_embeddings(tokens) + self.position_embeddings(
            torch.arange(tokens.shape[1]))


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query_key_value = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, HEADS, 3, HIDDEN // HEADS)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, HIDDEN))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.dense_4h_to_h = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class TransformerLayer(torch.nn.Module):  # ParallelTransformerLayerPipe's names
    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(HIDDEN)
        self.self_attention = Attention()
        self.post_attention_layernorm = torch.nn.LayerNorm(HIDDEN)
        self.mlp = Mlp()

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _cast(x):  # GPTModelPipe's first entry: a function, numbered like a layer
    return x


def _logits(embedding, hidden):
    return hidden @ embedding.word_embeddings_weight.t()


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def main(out_dir, steps, precision):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    specs = [_cast, TiedLayerSpec("embed", Embedding, tied_weight_attr="word_embeddings_weight"),
             *[LayerSpec(TransformerLayer) for _ in range(LAYERS)],
             LayerSpec(torch.nn.LayerNorm, HIDDEN),
             TiedLayerSpec("embed", Embedding, forward_fn=_logits,
                           tied_weight_attr="word_embeddings_weight")]
    torch.manual_seed(7)
    # (Megatron-DeepSpeed's topology has a tensor-slice axis: its files say "model_00")
    module = PipelineModule(layers=specs, loss_fn=_loss, partition_method="type:TransformerLayer",
                            topology=PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                        "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
              "bf16": {"enabled": precision == "bf16"}}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=config)
    generator = torch.Generator().manual_seed(0)

    def batches():
        while True:
            data = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
            yield data[:, :-1].contiguous(), data[:, 1:].contiguous()

    data = batches()
    for _ in range(int(steps)):
        engine.train_batch(data_iter=data)
    engine.save_checkpoint(os.path.join(out_dir, "ckpt"),
                           client_state={"iteration": int(steps)})
    live = {name: {"master": safe_get_full_fp32_param(p).clone(),
                   **{key: safe_get_full_optimizer_state(p, key).clone()
                      for key in ("exp_avg", "exp_avg_sq")}}
            for name, p in engine.module.named_parameters()}
    torch.save(live, os.path.join(out_dir, f"live_optimizer_rank{rank}.pt"))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
