"""Activations forward and their gradients backward between adjacent pipeline stages.

Every message is one [micro batch, sequence, hidden] tensor in the model's dtype, so both
sides know its shape in advance and nothing but the tensor travels. A send paired with a
receive from the same neighbour goes out as one batch of point-to-point operations, so two
stages exchanging in both directions cannot wait on each other (gloo and NCCL).
"""

import torch
import torch.distributed as dist

from megatron import mpu


class StageLinks:
    """This stage's links to the previous and the next stage of its pipeline."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.prev = None if mpu.is_pipeline_first_stage() \
            else mpu.get_pipeline_model_parallel_prev_rank()
        self.next = None if mpu.is_pipeline_last_stage() \
            else mpu.get_pipeline_model_parallel_next_rank()

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    @staticmethod
    def _run(ops):
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def recv_forward(self):
        """The previous stage's output (None on the first stage), as a leaf that collects
        this stage's input gradient."""
        if self.prev is None:
            return None
        tensor = self._empty()
        self._run([dist.P2POp(dist.irecv, tensor, self.prev)])
        return tensor.requires_grad_()

    def send_forward(self, output):
        if self.next is not None:
            self._run([dist.P2POp(dist.isend, output.detach().contiguous(), self.next)])

    def recv_backward(self):
        """The gradient of this stage's output (None on the last stage)."""
        if self.next is None:
            return None
        grad = self._empty()
        self._run([dist.P2POp(dist.irecv, grad, self.next)])
        return grad

    def send_backward(self, input_grad):
        if self.prev is not None:
            self._run([dist.P2POp(dist.isend, input_grad.contiguous(), self.prev)])

    def send_forward_recv_backward(self, output):
        """Send this micro batch's output and receive the gradient of the oldest output the
        next stage has not answered yet."""
        if self.next is None:
            return None
        grad = self._empty()
        self._run([dist.P2POp(dist.isend, output.detach().contiguous(), self.next),
                   dist.P2POp(dist.irecv, grad, self.next)])
        return grad

    def send_backward_recv_forward(self, input_grad):
        """Send an input gradient back and receive the next micro batch's input."""
        if self.prev is None:
            return None
        tensor = self._empty()
        self._run([dist.P2POp(dist.isend, input_grad.contiguous(), self.prev),
                   dist.P2POp(dist.irecv, tensor, self.prev)])
        return tensor.requires_grad_()
