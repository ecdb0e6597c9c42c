"""`--split 949,50,1`: train/valid/test weights, and the document ranges they cut.

No torch here: the config checks `--split` before anything heavy is imported.
"""

import math

from megatron.errors import DataError


def parse_splits(splits_string):
    """'949,50,1' or '949/50/1' (fewer entries pad with 0) -> three weights summing to 1."""
    separator = "," if "," in splits_string else "/"
    try:
        weights = [float(part) for part in splits_string.split(separator)]
    except ValueError:
        raise DataError(f"--split {splits_string!r} is not a list of numbers; use e.g. "
                        f"'949,50,1' (train,valid,test weights)") from None
    if len(weights) > 3:
        raise DataError(f"--split {splits_string!r} has {len(weights)} entries; it takes at "
                        f"most 3 (train,valid,test)")
    if any(not math.isfinite(w) or w < 0 for w in weights) or \
            not 0 < sum(weights) < math.inf:
        raise DataError(f"--split {splits_string!r} needs non-negative weights with a positive "
                        f"sum, e.g. '949,50,1'")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(splits_string, num_documents):
    """Boundaries [0, a, b, num_documents]: split k is documents [bounds[k], bounds[k+1])."""
    bounds = [0]
    for weight in parse_splits(splits_string):
        bounds.append(bounds[-1] + int(round(weight * float(num_documents))))
    # Rounding can overshoot or undershoot; Megatron shifts every boundary by the difference.
    # Clamping keeps a boundary from going negative (e.g. '0,1,1' over 3 documents).
    excess = bounds[-1] - num_documents
    shifted = [0] + [min(max(b - excess, 0), num_documents) for b in bounds[1:]]
    return [max(shifted[:k + 1]) for k in range(len(shifted))]
