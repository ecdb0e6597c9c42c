"""The checkpoint format of Adam8bit's and Adam4bit's state (zero/optim/quantized_adam.py):
the codes themselves, not fp32 moments, so an 8-bit state takes ~2 bytes per parameter on
disk (4-bit: ~2 as well; its codes are saved one per byte so that they can be cut anywhere).

One entry per stepped tensor, in the place of AdamW's {"step", "exp_avg", "exp_avg_sq"}:

    {"step": scalar,
     "exp_avg_codes": int8 or uint8 [numel], "exp_avg_sq_codes": uint8 [numel],  # 0 on
                                                             # elements of fp32-moment params
     "quantized": {"code": "8-bit" | "4-bit",
                   "scales": [[param key, first block, fp32 [2, blocks]], ...],  # m, v
                   "small": [[param key, first element, fp32 [2, elements]], ...]}}

The per-element codes are cut and re-joined like any per-element optimizer state, so every
checkpoint layout re-partitions them unchanged. The "quantized" table names each run of
scales (and each run of fp32 moments of small parameters) by its original parameter, so it
does not depend on the partitioning either: re-partitioning code merges the tables of every
saved piece (`merge_tables`) or keeps one parameter's runs (`restrict_table`). Loading turns
an entry back into fp32 moments (`decode`) with the loader's own pieces; Adam8bit and Adam4bit
requantise them to the same codes at their next step, so resuming stays exact, and any other
optimizer (AdamW after --optimizer adam) takes them as its moments.
"""

import torch

from zero.optim.pieces import Piece
from zero.optim.quantized_adam_kernels import CODES

TABLE = "quantized"
CODE_KEYS = ("exp_avg_codes", "exp_avg_sq_codes")


def is_quantized(entry):
    return isinstance(entry, dict) and TABLE in entry


def merge_tables(tables):
    """One table from the tables of several pieces of the same tensor (None: absent)."""
    tables = [t for t in tables if t is not None]
    if not tables:
        return None
    return {"code": tables[0]["code"],
            "scales": [run for t in tables for run in t["scales"]],
            "small": [run for t in tables for run in t["small"]]}


def restrict_table(table, key):
    """The runs of `table` that belong to the parameter named `key`."""
    return split_table(table).get(key, {"code": table["code"], "scales": [], "small": []})


def rename_table(table, key):
    """`table` (one parameter's runs) with its runs named `key`, a loader's name for that
    parameter (None stays None)."""
    if table is None:
        return None
    return {"code": table["code"],
            "scales": [[key, *run[1:]] for run in table["scales"]],
            "small": [[key, *run[1:]] for run in table["small"]]}


def split_table(table):
    """{parameter name: the runs of `table` that belong to it}."""
    parts = {}
    for kind in ("scales", "small"):
        for run in table[kind]:
            part = parts.setdefault(run[0], {"code": table["code"], "scales": [], "small": []})
            part[kind].append(run)
    return parts


def decode(entry, pieces, numel):
    """fp32 (exp_avg, exp_avg_sq) [numel] of a saved entry whose per-element codes lie as
    `pieces` (zero.optim.quantized_adam.Piece) say."""
    table = entry[TABLE]
    code = CODES[table["code"]]
    scales = _dense(table["scales"], 2)
    small = _dense(table["small"], 2)
    m_codes, v_codes = (entry[k].reshape(-1) for k in CODE_KEYS)
    m = torch.zeros(numel, dtype=torch.float32)
    v = torch.zeros(numel, dtype=torch.float32)
    for piece in pieces:
        a, b = piece.start, piece.start + piece.length
        lo, hi = piece.param_offset, piece.param_offset + piece.length
        if piece.param in scales:
            blocks = torch.arange(lo, hi) // code.block
            per_element = _take(scales, piece.param, blocks, "scales")
            m[a:b] = code.value_m(m_codes[a:b].view(-1, 1), per_element[0]).view(-1)
            v[a:b] = code.value_v(v_codes[a:b].view(-1, 1), per_element[1]).view(-1)
        else:
            moments = _take(small, piece.param, torch.arange(lo, hi), "fp32 moments")
            m[a:b], v[a:b] = moments[0], moments[1]
    return m, v


def decode_parameter_entry(entry):
    """AdamW's {"step", "exp_avg", "exp_avg_sq"} of one parameter's saved entry (a Megatron
    checkpoint keeps one per parameter, its table restricted to that parameter)."""
    keys = {run[0] for kind in ("scales", "small") for run in entry[TABLE][kind]}
    shape = entry[CODE_KEYS[0]].shape
    numel = entry[CODE_KEYS[0]].numel()
    if len(keys) != 1:
        raise ValueError(f"a parameter's quantised optimizer state names {len(keys)} "
                         "parameters in its table, not 1")
    m, v = decode(entry, [Piece(0, numel, keys.pop(), 0, numel)], numel)
    return {"step": entry["step"], "exp_avg": m.view(shape), "exp_avg_sq": v.view(shape)}


def decode_state_dict(state_dict, pieces_by_index, numels):
    """A torch optimizer state dict with every quantised entry decoded to AdamW's format."""
    state = {}
    for index, entry in state_dict["state"].items():
        if is_quantized(entry):
            m, v = decode(entry, pieces_by_index[index], numels[index])
            entry = {"step": entry["step"], "exp_avg": m, "exp_avg_sq": v}
        state[index] = entry
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _dense(runs, rows):
    """{param key: (fp32 [rows, n], which of the n some run covered)} from runs [key, first,
    values [rows, count]]."""
    sizes = {}
    for key, first, values in runs:
        sizes[key] = max(sizes.get(key, 0), first + values.shape[1])
    dense = {key: (torch.zeros(rows, n), torch.zeros(n, dtype=torch.bool))
             for key, n in sizes.items()}
    for key, first, values in runs:
        filled, covered = dense[key]
        filled[:, first:first + values.shape[1]] = values.float().cpu()
        covered[first:first + values.shape[1]] = True
    return dense


def _take(dense, key, index, what):
    filled, covered = dense.get(key, (None, None))
    if filled is None or int(index.max()) >= filled.shape[1] or not covered[index].all():
        raise ValueError(f"the saved quantised optimizer state has no {what} for part of "
                         f"parameter {key!r}: the checkpoint's pieces do not cover it")
    return filled[:, index]
