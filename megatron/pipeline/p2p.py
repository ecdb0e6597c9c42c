"""Activations forward and their gradients backward between adjacent pipeline stages.

Every message is one [micro batch, sequence, hidden] tensor in the model's dtype, so both
sides know its shape in advance and nothing but the tensor travels. The sends and receives
of one exchange go out as one batch of point-to-point operations, so two stages exchanging
in both directions cannot wait on each other (gloo and NCCL). Within a batch activations come
before gradients on both sides, so with two stages, where the previous and the next stage are
the same process, the messages pair up by their order (NCCL ignores tags; the per-kind tags
are a second guard under gloo).

With the interleaved schedule the stages form a ring: the last stage's next is the first
(its model chunk c feeds chunk c + 1 there).
"""

import torch
import torch.distributed as dist

from megatron import mpu

_ACTIVATION, _GRADIENT = 0, 1


class StageLinks:
    """This stage's links to the previous and the next stage of its pipeline."""

    def __init__(self, shape, dtype, device, ring=False):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        stages, stage = mpu.get_pipeline_model_parallel_world_size(), \
            mpu.get_pipeline_model_parallel_rank()
        first, last = stage == 0, stage == stages - 1
        self.prev = None if first and not ring else \
            mpu.get_pipeline_model_parallel_stage_rank((stage - 1) % stages)
        self.next = None if last and not ring else \
            mpu.get_pipeline_model_parallel_stage_rank((stage + 1) % stages)

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Send an output to the next stage and/or an input gradient to the previous one,
        receive an input from the previous stage and/or an output gradient from the next one,
        all at once: (received input as a leaf that collects its gradient, or None; received
        gradient or None)."""
        ops, received_input, received_grad = [], None, None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), self.next,
                                  tag=_ACTIVATION))
        if recv_prev:
            received_input = self._empty()
            ops.append(dist.P2POp(dist.irecv, received_input, self.prev, tag=_ACTIVATION))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.prev,
                                  tag=_GRADIENT))
        if recv_next:
            received_grad = self._empty()
            ops.append(dist.P2POp(dist.irecv, received_grad, self.next, tag=_GRADIENT))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if received_input is not None:
            received_input.requires_grad_()
        return received_input, received_grad

    # 1F1B's exchanges (no ring: the first stage receives no input, the last no gradient)

    def recv_forward(self):
        """The previous stage's output (None on the first stage)."""
        return self.exchange(recv_prev=self.prev is not None)[0]

    def send_forward(self, output):
        if self.next is not None:
            self.exchange(send_next=output)

    def recv_backward(self):
        """The gradient of this stage's output (None on the last stage)."""
        return self.exchange(recv_next=self.next is not None)[1]

    def send_backward(self, input_grad):
        if self.prev is not None:
            self.exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        """Send this micro batch's output and receive the gradient of the oldest output the
        next stage has not answered yet."""
        if self.next is None:
            return None
        return self.exchange(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        """Send an input gradient back and receive the next micro batch's input."""
        if self.prev is None:
            return None
        return self.exchange(send_prev=input_grad, recv_prev=True)[0]
