"""The order of a step's forward and backward passes on one pipeline stage.

1F1B (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM's schedules.py): stage s of P runs
min(P - s - 1, m) forward passes to fill the pipeline, then alternates one forward and one
backward, then drains the backward passes still owed. A stage holds at most P - s micro
batches' activations (GPipe: all m), and each stage idles (P - 1) / (m + P - 1) of the step,
the bubble.

A stage's forward is `forward_step(batch, engine, ctx)`: on the last stage it returns the
micro batch's loss, before it the hidden states the next stage starts from. Every stage reads
the same batches (the tokens feed the first stage, the labels the last). Backward goes through
the engine, so gradients accumulate, reduce over data parallelism and step exactly as without
stages; the engine's step after the last backward is the one collective all stages join (the
global norm and the overflow decision).
"""

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.pipeline.p2p import StageLinks
from megatron.pipeline.tied_embeddings import TiedEmbeddings


class PipelineStage:
    """What one stage (of two or more) runs a step or an evaluation with: links to its
    neighbours, the tied embeddings, the schedule."""

    def __init__(self, engine, ctx):
        self.engine, self.ctx = engine, ctx
        self.module = engine.module
        config = ctx.config
        shape = (config.training.batch_size, config.data.seq_length,
                 ctx.model_config.hidden_size)
        self.links = StageLinks(shape, config.precision.torch_dtype, ctx.runtime.device)
        self.tied = TiedEmbeddings(self.module, ctx.runtime.device,
                                   config.precision.torch_dtype)
        self.first, self.last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        self.stages = mpu.get_pipeline_model_parallel_world_size()
        self.stage = mpu.get_pipeline_model_parallel_rank()

    def _forward(self, forward_step, batches, input_tensor):
        if not self.first:
            self.module.set_input_tensor(input_tensor)
        return forward_step(next(batches), self.engine, self.ctx)

    def _backward(self, input_tensor, output, output_grad):
        """Backward of one micro batch; the gradient of this stage's input (None on the first
        stage)."""
        if self.last:
            self.engine.backward(output)
        else:
            self.engine.backward(output, grad=output_grad)
        return None if input_tensor is None else input_tensor.grad

    def train_step(self, forward_step, batches, count):
        """One step of `count` micro batches (1F1B). The summed losses, on every stage."""
        if self.tied.involved:
            self.tied.sync_weights()
        warmup = min(self.stages - self.stage - 1, count)
        steady = count - warmup
        in_flight = []  # (input, output) of micro batches whose backward is still owed
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.runtime.device)
        done = 0  # backward passes run

        def backward(input_tensor, output, output_grad):
            nonlocal done
            done += 1
            if self.first and done == count:
                self.tied.receive_grad()  # before the last backward adds the embedding's
            return self._backward(input_tensor, output, output_grad)

        def finish_backward(input_grad, recv_next):
            """Send the input gradient back (receiving the next input when `recv_next`), then
            the engine's step: after the sends, since the step after the last backward waits
            for every stage."""
            received = self.links.send_backward_recv_forward(input_grad) if recv_next \
                else self.links.send_backward(input_grad)
            if done == count and self.last:
                self.tied.send_grad()
            self.engine.step()  # acts after the last micro batch only
            return received

        for _ in range(warmup):
            input_tensor = self.links.recv_forward()
            output = self._forward(forward_step, batches, input_tensor)
            self.links.send_forward(output)
            in_flight.append((input_tensor, output))
        input_tensor = self.links.recv_forward() if steady else None
        for i in range(steady):
            output = self._forward(forward_step, batches, input_tensor)
            if self.last:
                total += output.detach().float()
            output_grad = self.links.send_forward_recv_backward(output)
            in_flight.append((input_tensor, output))
            oldest_input, oldest_output = in_flight.pop(0)
            input_grad = backward(oldest_input, oldest_output, output_grad)
            input_tensor = finish_backward(input_grad, recv_next=i < steady - 1)
        for _ in range(warmup):
            oldest_input, oldest_output = in_flight.pop(0)
            output_grad = self.links.recv_backward()
            input_grad = backward(oldest_input, oldest_output, output_grad)
            finish_backward(input_grad, recv_next=False)
        return self._from_last_stage(total)

    @torch.no_grad()
    def forward_only(self, forward_step, batches, count):
        """Evaluation: `count` forward passes through the pipeline; the summed losses, on
        every stage."""
        if self.tied.involved:
            self.tied.sync_weights()
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.runtime.device)
        for _ in range(count):
            output = self._forward(forward_step, batches, self.links.recv_forward())
            if self.last:
                total += output.float()
            else:
                self.links.send_forward(output)
        return self._from_last_stage(total)

    def _from_last_stage(self, total):
        dist.broadcast(total, src=mpu.get_pipeline_model_parallel_stage_rank(self.stages - 1),
                       group=mpu.get_pipeline_model_parallel_group())
        return total
