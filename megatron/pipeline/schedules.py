"""The order of a step's forward and backward passes on one pipeline stage.

1F1B (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM's schedules.py): stage s of P runs
min(P - s - 1, m) forward passes to fill the pipeline, then alternates one forward and one
backward, then drains the backward passes still owed. A stage holds at most P - s micro
batches' activations (GPipe: all m), and each stage idles (P - 1) / (m + P - 1) of the step,
the bubble.

Interleaved 1F1B (the same paper, section 2.2): each stage holds v model chunks, chunk c of
stage s being the (c x P + s)-th block of layers, and the stages form a ring. Micro batches
go through the chunks in groups of P, so a stage starts its next chunk's work while the
pipeline fills, and the bubble shrinks to (P - 1) / (v x m + P - 1) for v times the messages.

A stage's forward is `forward_step(batch, engine, ctx)`: on the last stage (last chunk) it
returns the micro batch's loss, before it the hidden states the next stage starts from. Every
stage reads the same batches (the tokens feed the first stage, the labels the last). Backward
goes through the engine, so gradients accumulate, reduce over data parallelism and step
exactly as without stages; the engine's step after the last backward is the one collective
all stages join (the global norm and the overflow decision), so it follows this stage's last
sends.
"""

import time

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
        self.chunks = mpu.get_virtual_pipeline_model_parallel_world_size()
        shape = (config.training.batch_size, config.data.seq_length,
                 ctx.model_config.hidden_size)
        self.links = StageLinks(shape, config.precision.torch_dtype, ctx.runtime.device,
                                ring=self.chunks > 1)
        self.tied = TiedEmbeddings(self.module, engine.optimizer, ctx.runtime.device,
                                   config.precision.torch_dtype)
        self.first = mpu.is_pipeline_first_stage(ignore_virtual=True)
        self.last = mpu.is_pipeline_last_stage(ignore_virtual=True)
        self.stages = mpu.get_pipeline_model_parallel_world_size()
        self.stage = mpu.get_pipeline_model_parallel_rank()
        # seconds in forward and backward passes, and from each step's first pass to this
        # stage's last backward (the bubble's measure)
        self._compute = self._span = 0.0
        self._schedule_start = None

    # ----- one step

    def train_step(self, forward_step, batches, count, lr_kwargs=None):
        """One step of `count` micro batches (the engine's step after the last gets
        `lr_kwargs`). The summed losses, on every stage."""
        if self.tied.involved:
            self.tied.sync_weights()
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.runtime.device)
        self._schedule_start = time.perf_counter()
        if self.chunks > 1:
            self._interleaved(forward_step, [next(batches) for _ in range(count)], count, total)
        else:
            self._one_f_one_b(forward_step, batches, count, total)
        self._finish(lr_kwargs)
        return self._from_last_stage(total)

    def bubble(self):
        """The pipeline bubble of the steps since the last call: the share of the schedule's
        span (the first forward to the last stage's last backward, the optimizer step left
        out) that a stage did not spend in its forward and backward passes, mean over the
        stages. It counts the waits for the other stages and the transfers, as the formula
        (P - 1) / (m + P - 1) counts the waits."""
        device = self.ctx.runtime.device  # NCCL reduces device tensors only
        span = torch.tensor([self._span], dtype=torch.float64, device=device)
        group = mpu.get_pipeline_model_parallel_group()
        dist.all_reduce(span, op=dist.ReduceOp.MAX, group=group)
        idle = torch.tensor([1.0 - self._compute / max(span.item(), 1e-9)],
                            dtype=torch.float64, device=device)
        dist.all_reduce(idle, group=group)
        self._compute = self._span = 0.0
        return idle.item() / self.stages

    def _forward(self, forward_step, batch, input_tensor, total, counted=True):
        start = time.perf_counter()
        if input_tensor is not None:
            self.module.set_input_tensor(input_tensor)
        output = forward_step(batch, self.engine, self.ctx)
        if counted and mpu.is_pipeline_last_stage():  # the loss (of the last chunk)
            total += output.detach().float()
        self._compute += time.perf_counter() - start
        return output

    def _backward(self, input_tensor, output, output_grad, final):
        """Backward of one micro batch (through one chunk); the gradient of its input (None on
        the first stage's first chunk). `final`: the step's last backward on this stage."""
        if final and self.first:
            self.tied.receive_grad()  # before the last backward adds the embedding's
        start = time.perf_counter()
        if mpu.is_pipeline_last_stage():
            self.engine.backward(output, reduce_gradients=final if self.chunks > 1 else None)
        else:
            self.engine.backward(output, grad=output_grad,
                                 reduce_gradients=final if self.chunks > 1 else None)
        if self.last:
            self.tied.collect_grad()
        self._compute += time.perf_counter() - start
        return None if input_tensor is None else input_tensor.grad

    def _finish(self, lr_kwargs):
        """After this stage's last sends: the output layer's gradient to the first stage, then
        the engine's step."""
        self._span += time.perf_counter() - self._schedule_start
        if self.last:
            self.tied.send_grad()
        self.engine.step(lr_kwargs=lr_kwargs)

    def _one_f_one_b(self, forward_step, batches, count, total):
        links = self.links
        warmup = min(self.stages - self.stage - 1, count)
        steady = count - warmup
        in_flight = []  # (input, output) of micro batches whose backward is still owed
        done = 0

        def backward(output_grad):
            nonlocal done
            done += 1
            input_tensor, output = in_flight.pop(0)
            return self._backward(input_tensor, output, output_grad, done == count)

        def step_unless_final():
            if done < count:
                self.engine.step()  # counts the micro batch; the last one steps in _finish

        for _ in range(warmup):
            input_tensor = links.recv_forward()
            output = self._forward(forward_step, next(batches), input_tensor, total)
            links.send_forward(output)
            in_flight.append((input_tensor, output))
        input_tensor = links.recv_forward() if steady else None
        for i in range(steady):
            output = self._forward(forward_step, next(batches), input_tensor, total)
            output_grad = links.send_forward_recv_backward(output)
            in_flight.append((input_tensor, output))
            input_grad = backward(output_grad)
            if i < steady - 1:
                input_tensor = links.send_backward_recv_forward(input_grad)
            else:
                links.send_backward(input_grad)
            step_unless_final()
        for _ in range(warmup):
            input_grad = backward(links.recv_backward())
            links.send_backward(input_grad)
            step_unless_final()

    def _chunk(self, k, forward):
        """The model chunk of this stage's k-th forward (or backward) pass: micro batches go
        through the chunks in groups of P, backward passes through the chunks in reverse."""
        chunk = k % (self.stages * self.chunks) // self.stages
        return chunk if forward else self.chunks - 1 - chunk

    def _micro_batch(self, k):
        """The micro batch of this stage's k-th forward pass."""
        return k // (self.stages * self.chunks) * self.stages + k % self.stages

    def _interleaved(self, forward_step, batches, count, total):
        links, stages, chunks = self.links, self.stages, self.chunks
        passes = count * chunks  # forward (and backward) passes of this stage
        if count == stages:
            warmup = passes  # every forward before the first backward
        else:
            warmup = min((stages - self.stage - 1) * 2 + (chunks - 1) * stages, passes)
        steady = passes - warmup
        inputs = [[] for _ in range(chunks)]
        outputs = [[] for _ in range(chunks)]
        grads = [[] for _ in range(chunks)]

        def forward(k):
            chunk = self._chunk(k, forward=True)
            mpu.set_virtual_pipeline_model_parallel_rank(chunk)
            if mpu.is_pipeline_first_stage() and len(inputs[chunk]) == len(outputs[chunk]):
                inputs[chunk].append(None)  # the embeddings start from the tokens
            output = self._forward(forward_step, batches[self._micro_batch(k)],
                                   inputs[chunk][-1], total)
            outputs[chunk].append(output)
            return None if mpu.is_pipeline_last_stage() else output

        def backward(k):
            chunk = self._chunk(k, forward=False)
            mpu.set_virtual_pipeline_model_parallel_rank(chunk)
            if mpu.is_pipeline_last_stage() and not grads[chunk]:
                grads[chunk].append(None)  # the loss starts the backward
            input_grad = self._backward(inputs[chunk].pop(0), outputs[chunk].pop(0),
                                        grads[chunk].pop(0), final=k == passes - 1)
            if chunk == 0 and k < passes - 1:
                self.engine.step()  # a micro batch's last chunk: counted
            return None if mpu.is_pipeline_first_stage() else input_grad

        def receives_input(k):
            """Whether forward pass k + 1 takes its input from the previous stage."""
            return k < passes - 1 and not (self.first and self._chunk(k + 1, True) == 0)

        try:
            mpu.set_virtual_pipeline_model_parallel_rank(0)
            inputs[0].append(links.exchange(recv_prev=not self.first)[0])
            for k in range(warmup):
                output = forward(k)
                recv_prev = receives_input(k)
                if k == warmup - 1 and warmup < passes:  # the first gradient arrives with it
                    received, grad = links.exchange(send_next=output, recv_prev=recv_prev,
                                                    recv_next=not self.last)
                    grads[chunks - 1].append(grad)
                else:
                    received, _ = links.exchange(send_next=output, recv_prev=recv_prev)
                if recv_prev:
                    inputs[self._chunk(k + 1, True)].append(received)
            for i in range(steady):
                k_forward, k_backward = i + warmup, i
                output = forward(k_forward)
                input_grad = backward(k_backward)
                # The first stage runs P - 1 passes ahead of the last: which chunk's input
                # (gradient) arrives next follows from the sender's position.
                if self.first:
                    sender = self._chunk(k_forward - (stages - 1), True)
                    recv_prev, next_input = sender != chunks - 1, sender + 1
                else:
                    recv_prev, next_input = True, self._chunk(k_forward + 1, True)
                if self.last:
                    sender = self._chunk(k_backward - (stages - 1), False)
                    recv_next, next_grad = sender != 0, sender - 1
                else:
                    recv_next, next_grad = True, self._chunk(k_backward + 1, False)
                if i == steady - 1:
                    recv_prev = False  # the last input came in the warm-up
                received, grad = links.exchange(send_next=output, send_prev=input_grad,
                                                recv_prev=recv_prev, recv_next=recv_next)
                if recv_prev:
                    inputs[next_input].append(received)
                if recv_next:
                    grads[next_grad].append(grad)
            if warmup == passes:
                grads[chunks - 1].append(links.exchange(recv_next=not self.last)[1])
            for k in range(steady, passes):
                input_grad = backward(k)
                recv_next = k < passes - 1 and not (
                    self.last and self._chunk(k + 1, False) == chunks - 1)
                _, grad = links.exchange(send_prev=input_grad, recv_next=recv_next)
                if recv_next:
                    grads[self._chunk(k + 1, False)].append(grad)
        finally:
            mpu.set_virtual_pipeline_model_parallel_rank(None)

    # ----- evaluation

    @torch.no_grad()
    def forward_only(self, forward_step, batches, count):
        """Evaluation: `count` forward passes through the pipeline; the summed losses, on
        every stage."""
        if self.tied.involved:
            self.tied.sync_weights()
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.runtime.device)
        compute = self._compute  # evaluation stays out of the training bubble
        try:
            self._forward_only(forward_step, batches, count, total)
        finally:
            self._compute = compute
        return self._from_last_stage(total)

    def _forward_only(self, forward_step, batches, count, total):
        if self.chunks == 1:
            for _ in range(count):
                output = self._forward(forward_step, next(batches), self.links.recv_forward(),
                                       total)
                if not self.last:
                    self.links.send_forward(output)
            return
        batches = [next(batches) for _ in range(count)]
        # micro batches go in groups of P: a short last evaluation batch is padded with
        # repeats whose losses are not counted
        counted = count
        batches += batches[-1:] * (-count % self.stages)
        passes = len(batches) * self.chunks
        inputs = [[] for _ in range(self.chunks)]
        try:
            mpu.set_virtual_pipeline_model_parallel_rank(0)
            inputs[0].append(self.links.exchange(recv_prev=not self.first)[0])
            for k in range(passes):
                chunk = self._chunk(k, forward=True)
                mpu.set_virtual_pipeline_model_parallel_rank(chunk)
                input_tensor = None if mpu.is_pipeline_first_stage() else inputs[chunk].pop(0)
                micro_batch = self._micro_batch(k)
                output = self._forward(forward_step, batches[micro_batch], input_tensor, total,
                                       counted=micro_batch < counted)
                send = None if mpu.is_pipeline_last_stage() else output
                recv_prev = k < passes - 1 and not (
                    self.first and self._chunk(k + 1, True) == 0)
                received, _ = self.links.exchange(send_next=send, recv_prev=recv_prev)
                if recv_prev:
                    inputs[self._chunk(k + 1, True)].append(received)
        finally:
            mpu.set_virtual_pipeline_model_parallel_rank(None)

    def _from_last_stage(self, total):
        dist.broadcast(total, src=mpu.get_pipeline_model_parallel_stage_rank(self.stages - 1),
                       group=mpu.get_pipeline_model_parallel_group())
        return total
