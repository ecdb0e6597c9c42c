"""Which elements of which original parameter a stepped tensor holds: what a ZeRO stage tells
an optimizer whose state is laid out on the original parameters (the quantisation blocks of
zero/optim/quantized_adam.py), and what that state's checkpoint format names its runs by."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """A run of a tensor's elements that belongs to one original parameter."""
    start: int          # first element in the stepped tensor
    length: int
    # a name of the original parameter: the same on every rank, and at any data-parallel
    # size (checkpoints name their runs by it); a plain value (torch.load's weights_only)
    param: object
    param_offset: int   # where the run starts in the original parameter
    param_numel: int
    # the size that decides quantised vs fp32 moments: the whole parameter's, also when this
    # process holds a tensor-parallel shard of it (None: param_numel)
    full_numel: int = None

    @property
    def quantized_at(self):
        return self.param_numel if self.full_numel is None else self.full_numel
