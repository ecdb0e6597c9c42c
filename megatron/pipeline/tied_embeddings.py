"""The output layer's word embeddings on the last pipeline stage.

GPT-2 multiplies its final hidden states by the input word embeddings. Under pipeline
parallelism those live on the first stage (a parameter: optimizer, checkpoint), and the last
stage holds a plain copy (`GPT2Model.tied_head_weight`). The copy's gradient, summed over the
step's micro batches, is added to the parameter's gradient before the first stage's last
backward, so the data-parallel reduction, the global norm and the optimizer see one gradient
of one parameter, as in a single process; the copy receives the parameter's values at the
start of every step and every evaluation. (Megatron keeps a second parameter and all-reduces
the two gradients; the traffic is the same, one matrix each way per step.) Where the engine
sums 16-bit gradients in fp32 (bf16's default), the copy's gradients are summed in fp32 too
and join the fp32 sums unrounded.
"""

import torch
import torch.distributed as dist

from megatron import mpu

# Under gloo, keeps these messages apart from the activations between the same two ranks;
# under NCCL (no tags) they cannot meet them: they are sent when no activation is in flight.
_TAG = 7


class TiedEmbeddings:
    def __init__(self, module, optimizer, device, dtype):
        self.module, self.optimizer = module, optimizer
        # (the same on every stage: the engine's settings come from the one config)
        self.grad_dtype = torch.float32 if optimizer.sums_gradients_in_fp32 else dtype
        self.grad_sum = None  # the last stage's fp32 sum of the copy's gradients this step
        self.first, self.last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        stages = mpu.get_pipeline_model_parallel_world_size()
        self.peer = mpu.get_pipeline_model_parallel_stage_rank(stages - 1 if self.first else 0)
        config = module.config
        shape = (config.vocab_size // mpu.get_model_parallel_world_size(), config.hidden_size)
        if self.first:
            self.weight = module.language_model.embedding.word_embeddings.weight
        elif self.last:
            self.weight = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
            module.tied_head_weight = self.weight

    @property
    def involved(self):
        return self.first or self.last

    @torch.no_grad()
    def sync_weights(self):
        """First stage -> the last stage's copy (before a step's or an evaluation's first
        forward: the optimizer or a checkpoint load may have changed the parameter)."""
        if self.first:
            dist.send(self.weight.detach().contiguous(), self.peer, tag=_TAG)
        elif self.last:
            dist.recv(self.weight.data, self.peer, tag=_TAG)

    @torch.no_grad()
    def collect_grad(self):
        """Last stage, after each backward: where gradients are summed in fp32, the copy's
        joins the step's fp32 sum (autograd would sum it in the copy's dtype)."""
        if self.grad_dtype == self.weight.dtype or self.weight.grad is None:
            return
        if self.grad_sum is None:
            self.grad_sum = self.weight.grad.to(self.grad_dtype)
        else:
            self.grad_sum.add_(self.weight.grad)
        self.weight.grad = None

    @torch.no_grad()
    def send_grad(self):
        """Last stage, after its last backward of the step: the copy's summed gradient."""
        grad = self.grad_sum if self.grad_sum is not None else self.weight.grad
        if grad is None:
            grad = torch.zeros_like(self.weight, dtype=self.grad_dtype)
        dist.send(grad.contiguous(), self.peer, tag=_TAG)
        self.weight.grad = self.grad_sum = None

    @torch.no_grad()
    def receive_grad(self):
        """First stage, before its last backward of the step: the output layer's gradient
        joins the embedding's, so the engine's reduction sees their sum."""
        grad = torch.empty_like(self.weight, dtype=self.grad_dtype)
        dist.recv(grad, self.peer, tag=_TAG)
        self.optimizer.add_to_gradient(self.weight, grad)
