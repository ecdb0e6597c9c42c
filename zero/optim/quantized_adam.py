"""AdamW with 8-bit (Adam8bit) or 4-bit (Adam4bit) block-wise optimizer states, laid out on
the original parameters.

Each moment is stored as codes with one fp32 scale per block of the *original* parameter
(Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", for the block-wise
idea; Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", for 4 bits): one byte
per element in blocks of 256, or half a byte in blocks of 128 (the codes themselves are in
zero/optim/quantized_adam_kernels.py). Whole blocks step in one compiled kernel over rows of
one block each; blocks cut by a partition take a slower path (torch.compile; eager PyTorch
where no compiler is available).
Parameters with fewer than `min_8bit_numel` / `min_4bit_numel` elements (counted over the
whole parameter, not a tensor-parallel shard of it) keep fp32 moments.

Partition-aware: under ZeRO the optimizer steps a flat partition that cuts parameters
anywhere. `describe_partition` tells it which elements of which original parameter each
partition element is; blocks are counted from each parameter's first element, and a block that
a partition cut splits (between ranks, or between two pieces on one rank) gets its scale from
a MAX over the pieces (one small all-reduce over data parallelism per step). So the states,
and the training, do not depend on the data-parallel size or the bucket size.

state_dict() holds the codes, with their scales named by original parameter
(zero/optim/quantized_state.py), so every checkpoint layout re-partitions it; loading decodes
it with this optimizer's own pieces, and requantising the decoded moments gives the same codes,
so resuming is exact. load_state_dict() also takes AdamW's format, and adamw_state_dict()
gives it, so a run can switch between AdamW, Adam8bit and Adam4bit.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero.optim.hyperparameters import check_adam_hyperparameters
from zero.optim.pieces import Piece
from zero.optim.quantized_adam_kernels import (EAGER_CHUNK, EIGHT_BIT, FOUR_BIT, adamw_update,
                                               pack_nibbles, row_kernels, unpack_nibbles)
from zero.optim.quantized_state import TABLE, decode_state_dict

MIN_QUANTIZED_NUMEL = 4096


# ------------------------------------------------------------------------------ the layout

@dataclass
class _Plan:
    """How one stepped tensor's elements map onto blocks and state."""
    quantized: list     # [(piece, regions, first scale slot)]; regions as in _regions
    small: list         # [(piece, first element of the fp32 state)]
    num_scales: int
    small_numel: int
    shared: dict        # scale slot -> index in the optimizer's shared-block vector


def _regions(piece, block):
    """(head, body, tail) lengths: the part of the first block the piece shares with what
    comes before it, whole blocks, and the rest."""
    head = min((-piece.param_offset) % block, piece.length)
    body = (piece.length - head) // block * block
    return head, body, piece.length - head - body


def _partial_blocks(piece, block):
    """{which: (param, block index)} for the head / tail block of the piece when other
    pieces hold the rest of it."""
    head, body, tail = _regions(piece, block)
    found = {}
    if head:
        found["head"] = (piece.param, piece.param_offset // block)
    if tail:
        end = piece.param_offset + piece.length
        index = (end - 1) // block
        if end < min((index + 1) * block, piece.param_numel):  # the block goes on elsewhere
            found["tail"] = (piece.param, index)
    return found


def _make_plan(pieces, shared_index, min_numel, block):
    quantized, small, slots, small_numel, shared = [], [], 0, 0, {}
    for piece in pieces:
        if piece.quantized_at < min_numel:
            small.append((piece, small_numel))
            small_numel += piece.length
            continue
        head, body, tail = _regions(piece, block)
        quantized.append((piece, (head, body, tail), slots))
        count = (1 if head else 0) + body // block + (1 if tail else 0)
        for which, block_id in _partial_blocks(piece, block).items():
            if block_id in shared_index:
                shared[slots if which == "head" else slots + count - 1] = shared_index[block_id]
        slots += count
    return _Plan(quantized, small, slots, small_numel, shared)


def state_bytes_per_param(numels, min_numel=MIN_QUANTIZED_NUMEL, code=EIGHT_BIT):
    """(bytes of optimizer state per parameter, the formula in words) for parameters of these
    sizes (whole-parameter sizes: they decide quantised or fp32)."""
    total = sum(numels)
    quantized = sum(n for n in numels if n >= min_numel)
    blocks = sum(math.ceil(n / code.block) for n in numels if n >= min_numel)
    # 8 bits: every element has its two code bytes (a flat partition mixes both kinds);
    # 4 bits: every block of a quantised tensor has its row of codes
    codes = code.bytes_per_element * total if code.per_element else 2 * code.row_bytes * blocks
    state = codes + 8 * blocks + 8 * (total - quantized)
    width = f"{code.bytes_per_element:g} B" + ("" if code.per_element else " per quantised element")
    formula = (f"{width} + 2 x 4 B per {code.block}-element block, plus 8 B on the "
               f"{total - quantized:,} of {total:,} params in tensors under {min_numel} "
               f"elements")
    return state / max(total, 1), formula


# ------------------------------------------------------------------------------ the optimizer

class QuantizedAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with block-wise quantised moments in
    the format `code` (a subclass picks it).

    Without `describe_partition`, every parameter is its own original parameter.
    `compiled=False` runs the row kernels eagerly (the same formulas, several passes)."""

    code = None
    min_numel_name = None  # the constructor argument that sets min_numel

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 min_numel=MIN_QUANTIZED_NUMEL, compiled=True):
        if self.code is None:
            raise TypeError("QuantizedAdam is the machinery; construct Adam8bit or Adam4bit")
        check_adam_hyperparameters(type(self).__name__, lr, betas, eps, weight_decay)
        if not min_numel >= 0:
            raise ValueError(f"{type(self).__name__}: invalid {self.min_numel_name} "
                             f"{min_numel!r} (must be >= 0)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.min_numel = int(min_numel)
        self.compiled = compiled  # the row kernels through torch.compile (else eager)
        self._pieces = {}        # tensor -> [Piece]
        self._shared = {}        # (param, block) -> index in the shared vector
        self._comm_group = None  # the data-parallel group blocks may be split over
        self._plans = {}

    def describe_partition(self, pieces_by_tensor, all_ranks_pieces, group=None):
        """`pieces_by_tensor`: {stepped tensor: [Piece]} on this rank; `all_ranks_pieces`:
        every rank's pieces (lists of Piece), to agree on the blocks cuts split; `group`: the
        process group those ranks form (None: one process)."""
        self._pieces = dict(pieces_by_tensor)
        holders = {}
        for rank_pieces in all_ranks_pieces:
            for piece in rank_pieces:
                if piece.quantized_at >= self.min_numel:
                    for block_id in _partial_blocks(piece, self.code.block).values():
                        holders[block_id] = holders.get(block_id, 0) + 1
        shared = sorted((b for b, n in holders.items() if n > 1), key=repr)
        self._shared = {block_id: i for i, block_id in enumerate(shared)}
        self._comm_group = group
        self._plans = {}

    def _plan(self, p):
        plan = self._plans.get(p)
        if plan is None:
            plan = self._plans[p] = _make_plan(self._pieces_of(p), self._shared,
                                               self.min_numel, self.code.block)
        return plan

    def _pieces_of(self, p):
        """The pieces `describe_partition` gave, else the whole tensor as its own parameter,
        named by its position among the optimizer's tensors (as checkpoints number them)."""
        if p in self._pieces:  # possibly none: a partition of padding only
            return self._pieces[p]
        index = next(i for i, q in enumerate(self._tensors()) if q is p)
        return [Piece(0, p.numel(), index, 0, p.numel())]

    def _tensors(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _kernels(self):
        return row_kernels(self.code, self.compiled)

    # ----- state -----

    def _init_state(self, p):
        plan, state, code = self._plan(p), self.state[p], self.code
        device = p.device
        state.setdefault("step", torch.zeros((), dtype=torch.float32))
        shape = (p.numel(),) if code.per_element else (plan.num_scales, code.row_bytes)
        state["m_codes"] = torch.zeros(shape, dtype=code.m_dtype, device=device)
        state["v_codes"] = torch.zeros(shape, dtype=torch.uint8, device=device)
        if not code.per_element:  # every row starts as zeros: m = 0, v = its smallest code
            state["m_codes"].fill_(code.pad_m)
            state["v_codes"].fill_(code.pad_v)
        state["m_scales"] = torch.zeros(plan.num_scales, dtype=torch.float32, device=device)
        state["v_scales"] = torch.zeros(plan.num_scales, dtype=torch.float32, device=device)
        state["m_small"] = torch.zeros(plan.small_numel, dtype=torch.float32, device=device)
        state["v_small"] = torch.zeros(plan.small_numel, dtype=torch.float32, device=device)

    def _saved_entry(self, p):
        """The checkpoint entry of tensor `p` (zero/optim/quantized_state.py): per-element
        codes (4 bits: one per byte, so they can be cut anywhere) and the table of scales and
        small parameters' fp32 moments, named by original parameter."""
        plan, state, code = self._plan(p), self.state[p], self.code
        if code.per_element:
            m_codes, v_codes = state["m_codes"].cpu().clone(), state["v_codes"].cpu().clone()
        else:
            m_codes = torch.zeros(p.numel(), dtype=torch.uint8)
            v_codes = torch.zeros(p.numel(), dtype=torch.uint8)
        scales, small = [], []
        for piece, regions, slot in plan.quantized:
            spans = _spans(regions, slot, code.block)
            count = spans[-1][2][1] - slot
            scales.append([piece.param, piece.param_offset // code.block, torch.stack(
                (state["m_scales"][slot:slot + count], state["v_scales"][slot:slot + count])
            ).cpu()])
            if code.per_element:
                continue
            for lo, hi, (first, last) in spans:
                a, b = piece.start + lo, piece.start + hi
                rows = _Rows(a, b, first, last, code)
                m_codes[a:b] = rows.elements(unpack_nibbles(rows.codes(state["m_codes"],
                                                                       code.pad_m)))
                v_codes[a:b] = rows.elements(unpack_nibbles(rows.codes(state["v_codes"],
                                                                       code.pad_v)))
        for piece, at in plan.small:
            small.append([piece.param, piece.param_offset, torch.stack(
                (state["m_small"][at:at + piece.length],
                 state["v_small"][at:at + piece.length])).cpu()])
        return {"step": state["step"].clone(), "exp_avg_codes": m_codes,
                "exp_avg_sq_codes": v_codes,
                TABLE: {"code": code.name, "scales": scales, "small": small}}

    def state_dict(self):
        """The codes and their scales (zero/optim/quantized_state.py has the format); a
        tensor loaded from AdamW's format and not stepped since keeps that format."""
        packed = super().state_dict()
        index = {id(p): i for i, p in enumerate(self._tensors())}
        for p in self.state:
            entry = self.saved_entry(p)
            if entry:
                packed["state"][index[id(p)]] = entry
        return packed

    def saved_entry(self, p):
        """Tensor `p`'s entry of the state dict ({} before its first step)."""
        state = self.state.get(p, {})
        if "pending" in state:
            m, v = state["pending"]
            return {"step": state["step"].clone(), "exp_avg": m, "exp_avg_sq": v}
        return self._saved_entry(p) if "m_codes" in state else {}

    def adamw_state_dict(self):
        """The state in AdamW's format (fp32 exp_avg / exp_avg_sq), for torch.optim.AdamW."""
        return self._decoded(self.state_dict())

    def _decoded(self, state_dict):
        tensors = self._tensors()
        return decode_state_dict(state_dict, {i: self._pieces_of(p) for i, p in
                                              enumerate(tensors)},
                                 {i: p.numel() for i, p in enumerate(tensors)})

    def load_state_dict(self, state_dict):
        """Takes this format (from either width) or AdamW's; the moments are quantised at the
        next step (every rank steps together, as shared blocks need), to the same codes when
        they come from this optimizer."""
        super().load_state_dict(self._decoded(state_dict))
        for p, state in self.state.items():
            if "step" in state:  # stepped in place: never the caller's tensor
                state["step"] = state["step"].clone()
            if "exp_avg" in state:  # a copy: a live optimizer's state_dict shares its tensors
                state["pending"] = (state.pop("exp_avg").clone(),
                                    state.pop("exp_avg_sq").clone())

    def state_bytes(self):
        """Bytes of state this optimizer holds, over all its tensors."""
        return sum(t.numel() * t.element_size() for s in self.state.values()
                   for t in s.values() if torch.is_tensor(t))

    # ----- the step -----

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = self.begin_step()
        for group in self.param_groups:
            for p in group["params"]:
                self.step_param(p, pending, group)
        self.finish_step(pending)
        return loss

    # A step in three calls, for a caller that brings each tensor into memory in turn (the
    # fp32 masters in NVMe swap files): begin_step(), step_param() per tensor in the order of
    # the param groups, finish_step() (which settles the blocks shared between tensors and
    # ranks: every rank calls it).

    def begin_step(self):
        return _SharedBlocks(len(self._shared))

    @torch.no_grad()
    def step_param(self, p, pending, group=None):
        if p.grad is None:
            return
        if group is None:
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        beta1, beta2 = group["betas"]
        state = self.state[p]
        loaded = state.pop("pending", None)  # fp32 moments from a checkpoint
        if "m_codes" not in state:
            self._init_state(p)
        state["step"] += 1
        step = float(state["step"])
        hyper = torch.tensor([group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                              1 - beta1 ** step, 1 - beta2 ** step],
                             dtype=torch.float32, device=p.device)
        self._step_tensor(p, p.grad.reshape(-1), hyper, pending, loaded)

    def finish_step(self, pending):
        pending.finish(self._comm_group, self._kernels())

    def _step_tensor(self, p, grad, hyper, pending, loaded=None):
        """Update `p` and its moments; `loaded`: fp32 (exp_avg, exp_avg_sq) to start from
        instead of the codes (the first step after loading a checkpoint)."""
        plan, state, kernels, code = self._plan(p), self.state[p], self._kernels(), self.code
        flat = p.detach().view(-1)  # a Parameter would make the kernels compile once more
        if loaded is not None:
            loaded = [t.reshape(-1).to(p.device, torch.float32) for t in loaded]
        for piece, regions, slot in plan.quantized:
            for lo, hi, (first, last) in _spans(regions, slot, code.block, kernels.chunk):
                a, b = piece.start + lo, piece.start + hi
                rows = _Rows(a, b, first, last, code)
                shared = plan.shared.get(first)
                if loaded is None and shared is None and rows.whole:  # all in place
                    kernels.step_and_quantize(rows.take(flat), rows.take(grad),
                                              *rows.state(state), hyper)
                    continue
                param, grad_rows = rows.take(flat), rows.take(grad)
                if loaded is not None:
                    m, v = kernels.step_from(param, grad_rows, rows.take(loaded[0]),
                                             rows.take(loaded[1]), hyper)
                else:
                    m, v = kernels.step(param, grad_rows, *rows.state(state), hyper)
                rows.put(flat, param)
                if shared is not None:  # a head or tail block: one row
                    pending.add(shared, state, rows, m, v)
                else:
                    rows.quantize(state, m, v, m.abs().amax(1), v.amax(1), kernels)
        for piece, at in plan.small:
            a, b = piece.start, piece.start + piece.length
            m_small = state["m_small"][at:at + piece.length]
            v_small = state["v_small"][at:at + piece.length]
            if loaded is not None:
                m_small.copy_(loaded[0][a:b])
                v_small.copy_(loaded[1][a:b])
            new_param, m, v = adamw_update(flat[a:b], grad[a:b], m_small, v_small, hyper)
            flat[a:b], m_small[:], v_small[:] = new_param, m, v


class Adam8bit(QuantizedAdam):
    """AdamW with 8-bit moments in blocks of 256 (about 2 bytes of state per parameter)."""

    code = EIGHT_BIT
    min_numel_name = "min_8bit_numel"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 min_8bit_numel=MIN_QUANTIZED_NUMEL, compiled=True):
        super().__init__(params, lr, betas, eps, weight_decay, min_8bit_numel, compiled)


class Adam4bit(QuantizedAdam):
    """AdamW with 4-bit moments in blocks of 128 (about 1.06 bytes of state per parameter)."""

    code = FOUR_BIT
    min_numel_name = "min_4bit_numel"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 min_4bit_numel=MIN_QUANTIZED_NUMEL, compiled=True):
        super().__init__(params, lr, betas, eps, weight_decay, min_4bit_numel, compiled)


# the names a config or --optimizer gives them (lower case)
QUANTIZED_ADAMS = {"adam8bit": Adam8bit, "adamw8bit": Adam8bit, "adam4bit": Adam4bit,
                   "adamw4bit": Adam4bit}


class _Rows:
    """Elements [a, b) of a stepped tensor with scale slots [first, last), as rows of one
    block each for the kernels. A part of a block, or a single block, is copied into two
    padded rows: the kernels then see the same shapes (never a specialised one-row case), and
    padding (zeros, and codes of m = 0 and the smallest v) does not raise a block's absmax;
    the padding itself is discarded."""

    def __init__(self, a, b, first, last, code):
        self.a, self.b, self.first, self.last = a, b, first, last
        self.code = code
        self.count = last - first
        self.whole = (b - a) == self.count * code.block and self.count > 1

    def take(self, tensor):
        """Per-element `tensor`'s elements [a, b) as rows."""
        if self.whole:
            return tensor[self.a:self.b].view(self.count, self.code.block)
        rows = torch.zeros(max(2, self.count), self.code.block, dtype=tensor.dtype,
                           device=tensor.device)
        rows.view(-1)[:self.b - self.a] = tensor[self.a:self.b]
        return rows

    def elements(self, rows):
        """The elements [a, b) of `rows` as take() laid them out, flat."""
        return rows.reshape(-1)[:self.b - self.a]

    def scales(self, scales):
        if self.whole:
            return scales[self.first:self.last]
        padded = torch.zeros(max(2, self.count), dtype=scales.dtype, device=scales.device)
        padded[:self.count] = scales[self.first:self.last]
        return padded

    def codes(self, codes, pad):
        """Code rows: per-element codes as take() does; one row per slot as a view, or a
        padded copy whose positions past the elements hold `pad`."""
        if self.code.per_element:
            return self.take(codes)
        if self.whole:
            return codes[self.first:self.last]
        nibbles = torch.full((max(2, self.count), self.code.block), pad & 15, dtype=torch.uint8,
                             device=codes.device)
        real = unpack_nibbles(codes[self.first:self.last]).reshape(-1)[:self.b - self.a]
        nibbles.view(-1)[:self.b - self.a] = real
        return pack_nibbles(nibbles)

    def state(self, state):
        """(m codes, m scales, v codes, v scales) of these rows."""
        return (self.codes(state["m_codes"], self.code.pad_m), self.scales(state["m_scales"]),
                self.codes(state["v_codes"], self.code.pad_v), self.scales(state["v_scales"]))

    def put(self, tensor, rows):
        """Write rows back to elements [a, b) of `tensor` (a view from take() already is)."""
        if not (self.whole and rows.data_ptr() == tensor[self.a:self.b].data_ptr()):
            tensor[self.a:self.b] = self.elements(rows)

    def put_codes(self, codes, rows):
        if self.code.per_element:
            self.put(codes, rows)
        elif not (self.whole and rows.data_ptr() == codes[self.first:self.last].data_ptr()):
            codes[self.first:self.last] = rows[:self.count]

    def quantize(self, state, m, v, m_scale, v_scale, kernels):
        """Codes of the updated moments `m`, `v` (rows as take() gave) at these scales."""
        m_codes, v_codes = kernels.quantize(m, v, m_scale, v_scale)
        self.put_codes(state["m_codes"], m_codes)
        self.put_codes(state["v_codes"], v_codes)
        state["m_scales"][self.first:self.last] = m_scale[:self.count]
        state["v_scales"][self.first:self.last] = v_scale[:self.count]


class _SharedBlocks:
    """Blocks split between pieces: their updated values wait here until the MAX of every
    piece's absmax is known (an all-reduce over the ranks that hold pieces of them)."""

    def __init__(self, count):
        self.maxima = torch.zeros(2, count, dtype=torch.float32)
        self.waiting = []

    def add(self, index, state, rows, m, v):
        # torch.maximum, not max(): a NaN must reach the scale, as in an unshared block
        self.maxima[0, index] = torch.maximum(self.maxima[0, index], m.abs().max().cpu())
        self.maxima[1, index] = torch.maximum(self.maxima[1, index], v.max().cpu())
        self.waiting.append((index, state, rows, m, v))

    def finish(self, group, kernels):
        if self.maxima.numel() and group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(self.maxima, op=dist.ReduceOp.MAX, group=group)
        for index, state, rows, m, v in self.waiting:
            scales = self.maxima[:, index:index + 1].to(m.device).expand(2, m.shape[0])
            rows.quantize(state, m, v, scales[0].contiguous(), scales[1].contiguous(),
                          kernels)
        self.waiting = []


def _spans(regions, slot, block, chunk=EAGER_CHUNK):
    """[(lo, hi, (first scale slot, end scale slot))] of a piece's spans, each a whole number
    of its scale slots: the head, the body in chunks, the tail."""
    assert chunk % block == 0, "a chunk is a whole number of blocks"
    head, body, tail = regions
    spans, at, s = [], 0, slot
    if head:
        spans.append((0, head, (s, s + 1)))
        at, s = head, s + 1
    for lo in range(at, at + body, chunk):
        hi = min(lo + chunk, at + body)
        blocks = (hi - lo) // block
        spans.append((lo, hi, (s, s + blocks)))
        s += blocks
    if tail:
        spans.append((at + body, at + body + tail, (s, s + 1)))
    return spans
