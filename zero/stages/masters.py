"""Where a ZeRO stage's fp32 master weights and optimizer state live, and how they are stepped.

A stage optimizer (stage1_2.py, stage3.py) owns the partitions of the model, their fp32
gradients and all communication. Everything about the masters it asks of a master store,
one master per key (a stage 1/2 param group, a stage 3 sub-group):

    DeviceMasters   no offload: masters on the compute device, stepped by the torch
                    optimizer (fused Adam where it can); a master may be the fp32 partition
                    itself
    HostMasters     offload_optimizer "cpu" or "nvme" (zero/offload/host_masters.py): masters
                    and Adam moments in host memory or swap files, stepped by CPUAdam one
                    sub-group at a time

The protocol both follow, in the order a stage uses it:

    master = store.new_master(numel, device, alias=None)   per key; alias: the fp32
                 partition that is the master itself (DeviceMasters only, `can_alias`)
    grad = store.grad_buffer(master)                        the master's fp32 gradient
    optimizer = store.finish(optimizer)                     once every master is in the torch
                 optimizer's param groups; returns the optimizer the stage steps through
    store.write(key, lo, values)       master elements [lo, lo + n) <- values (the partition)
    store.step(write_back, grad_divisor)
                                       one optimizer step on the masters' gradients divided
                                       by grad_divisor (the loss scale and the clip, inside
                                       the Adam kernel where it takes it: one pass fewer over
                                       the gradients); write_back(key, lo, updated) gets
                                       every updated range (not for aliased masters)
    store.publish(write_back)          write_back every master (after a checkpoint load)
    read_master / state_dict / restore_target / commit / load_state_dict   checkpoints
    saved_state(key)                   one master's optimizer state, as state_dict has it
    master_bytes / state_bytes / close
"""

import torch


class DeviceMasters:
    can_alias = True
    frees_grads = True  # stage 3 frees partition gradients between steps
    copies_back_async = False  # write_back's values are device tensors already

    def __init__(self):
        self.masters, self.aliased, self.optimizer = [], [], None

    def new_master(self, numel, device, alias=None):
        master = torch.nn.Parameter(alias if alias is not None else
                                    torch.empty(numel, dtype=torch.float32, device=device))
        self.masters.append(master)
        self.aliased.append(alias is not None)
        return master

    @staticmethod
    def grad_buffer(master):
        return torch.zeros_like(master)

    def finish(self, optimizer):
        self.optimizer = optimizer
        self._default_to_fused()
        return optimizer

    def _default_to_fused(self):
        """torch's fused Adam on flat fp32 tensors is ~5x faster than the default on CPU, and
        takes the step's divisor in its kernel. Groups that chose no implementation get it
        (also after a load: a state saved under offload has CPUAdam's groups, fused None)."""
        if type(self.optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            for group in self.optimizer.param_groups:
                if group.get("fused") is None and not group.get("foreach") \
                        and not group.get("differentiable") and not group.get("capturable"):
                    group["fused"] = True

    @torch.no_grad()
    def write(self, key, lo, values):
        if not self.aliased[key]:
            self.masters[key].narrow(0, lo, values.numel()).copy_(values.reshape(-1))

    def step(self, write_back, grad_divisor=1.0):
        if grad_divisor != 1.0 and self._fused_adam():
            # what torch's GradScaler hands the fused kernel: grads / grad_scale as it reads them
            device = self.masters[0].device
            self.optimizer.grad_scale = torch.full((), grad_divisor, dtype=torch.float32,
                                                    device=device)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale
        else:
            divide_grads(self.masters, grad_divisor)
            self.optimizer.step()
        self.publish(write_back)

    def _fused_adam(self):
        """Whether the optimizer is torch's fused Adam(W) in every group (checked at each step:
        a checkpoint load replaces the group dicts)."""
        return type(self.optimizer) in (torch.optim.Adam, torch.optim.AdamW) \
            and all(group.get("fused") for group in self.optimizer.param_groups)

    @torch.no_grad()
    def publish(self, write_back):
        for key, master in enumerate(self.masters):
            if not self.aliased[key]:
                write_back(key, 0, master.detach())

    # ----- checkpoints -----

    def read_master(self, key):
        return self.masters[key].detach()

    def saved_state(self, key):
        return saved_state_of(self.optimizer, self.masters[key])

    def state_dict(self):
        return self.optimizer.state_dict()

    def restore_target(self, key):
        return self.masters[key].data

    def commit(self):
        """After the restore targets are filled: nothing to move."""

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)
        self._default_to_fused()

    # ----- accounting -----

    def master_bytes(self):
        return sum(m.numel() * 4 for m, a in zip(self.masters, self.aliased) if not a)

    def state_bytes(self):
        return sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                   for v in s.values() if torch.is_tensor(v) and v.dim() > 0)

    def close(self):
        pass


def saved_state_of(optimizer, master):
    """`master`'s optimizer state as the optimizer's state dict holds it: AdamW's tensors, or
    Adam8bit/4bit's codes (zero/optim/quantized_state.py); {} before its first step."""
    saved_entry = getattr(optimizer, "saved_entry", None)
    return saved_entry(master) if saved_entry is not None else optimizer.state.get(master, {})


@torch.no_grad()
def divide_grads(masters, divisor):
    """masters' gradients /= divisor, for an optimizer that cannot take the divisor itself."""
    if divisor != 1.0:
        for master in masters:
            master.grad.mul_(1.0 / divisor)
