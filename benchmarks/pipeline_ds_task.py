"""DeepSpeed's PipelineEngine on the model of benchmarks/pipeline.py, for that benchmark.

Runs inside the DeepSpeed venv (torch and deepspeed only), one process per stage, started by
deepspeed_venv.launch_ranks:  pipeline_ds_task.py '<json config with m and stages>'
Prints one JSON line: the median seconds of a train_batch after warm-up.
"""

import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from train_throughput import _Block as Block  # the plain-PyTorch GPT block (torch only)


class Embed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.wpe = nn.Embedding(c["seq_length"], c["hidden_size"])

    def forward(self, tokens):
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))


class Head(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_f = nn.LayerNorm(c["hidden_size"])
        self.head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, x):
        return self.head(self.ln_f(x))


def main(config):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    c = config
    vocab = c["vocab_size"]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().view(-1, vocab), labels.reshape(-1))

    layers = [LayerSpec(Embed, c)] + \
        [LayerSpec(Block, c["hidden_size"], c["num_attention_heads"])
         for _ in range(c["num_layers"])] + [LayerSpec(Head, c)]
    torch.manual_seed(0)
    module = PipelineModule(layers=layers, num_stages=c["stages"], loss_fn=loss_fn,
                            partition_method="type:Block")
    ds_config = {"train_micro_batch_size_per_gpu": c["micro_batch"],
                 "gradient_accumulation_steps": c["m"],
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01,
                                                           "torch_adam": True}},
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 0},
                 "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=ds_config)
    data = torch.randint(0, vocab, (c["micro_batch"], c["seq_length"] + 1),
                         generator=torch.Generator().manual_seed(0))
    batch = (data[:, :-1].contiguous(), data[:, 1:].contiguous())
    batches = iter(lambda: batch, None)
    seconds = []
    for step in range(c["warmup"] + c["steps"]):
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.train_batch(data_iter=batches)
        if step >= c["warmup"]:
            seconds.append(time.perf_counter() - start)
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"median_seconds": statistics.median(seconds)}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
