"""A weighted blend of several datasets: `--data-path 0.3 A 0.7 B`, as Megatron-LM 2.x and
later take it (or `--data-path A B`, weighted by each dataset's tokens, as Megatron-core).

Each dataset is cut by --split and sampled as alone (its own index maps, for at least its
share of the samples plus 0.5%, Megatron-LM's margin); sample i of a split's blend is the
next unserved sample of the dataset furthest behind its share after i samples, the first on
ties (the rule of Megatron-LM's build_blending_indices), so that after any number of samples
every dataset's count is within two of its share. That per-sample choice is computed once per
blend and sample count, on rank 0, and cached beside the first dataset.
"""

import hashlib
import json
import os
import time

import numpy as np
import torch

MARGIN = 1.005  # each dataset's samples over its share (Megatron-LM's)


def blending_choices(weights, num_samples):
    """int16 [num_samples]: the dataset of each sample of the blend (the module's rule)."""
    weights = [float(w) for w in weights]
    counts, choices = [0] * len(weights), np.zeros(num_samples, dtype=np.int16)
    others = range(1, len(weights))
    for sample in range(num_samples):  # (plain floats: ~0.3 us a sample)
        at = sample if sample > 1 else 1.0
        chosen, furthest = 0, weights[0] * at - counts[0]
        for d in others:
            behind = weights[d] * at - counts[d]
            if behind > furthest:
                chosen, furthest = d, behind
        choices[sample] = chosen
        counts[chosen] += 1
    return choices


def samples_within(choices, num_datasets):
    """int64 [len(choices)]: which sample of its dataset each sample of the blend is."""
    within = np.empty(len(choices), dtype=np.int64)
    for d in range(num_datasets):
        chosen = choices == d
        within[chosen] = np.arange(int(chosen.sum()), dtype=np.int64)
    return within


class BlendedDataset(torch.utils.data.Dataset):
    """`num_samples` samples drawn from `datasets` by `choices` (blending_choices)."""

    def __init__(self, name, datasets, choices, choices_path):
        self.name, self.datasets = name, list(datasets)
        self.choices = choices
        self.within = samples_within(choices, len(self.datasets))
        self.map_paths = [choices_path] + [p for d in self.datasets for p in d.map_paths]

    def __len__(self):
        return len(self.choices)

    def __getitem__(self, idx):
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.name} sample {idx} out of range (length {len(self)})")
        return self.datasets[int(self.choices[idx])][int(self.within[idx])]


def cached_choices(name, prefixes, weights, num_samples, group=None):
    """(blending_choices, the .npy it is cached in beside the first dataset; rank 0 of `group`
    builds it)."""
    from megatron.data.index_maps import save_atomic
    from megatron.data.rank_zero import build_on_rank_zero, log_rank_zero
    key = json.dumps([[os.path.realpath(p), w] for p, w in zip(prefixes, weights)])
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    path = f"{prefixes[0]}_{name}_blend_{digest}_{num_samples}ns_choices.npy"

    def build_if_needed():
        if _loads_with_length(path, num_samples):
            return
        start = time.perf_counter()
        save_atomic(path, blending_choices(weights, num_samples))
        log_rank_zero(f" > built the {name} blend of {len(prefixes)} datasets in "
                      f"{time.perf_counter() - start:.2f} s: {num_samples} samples ({path})")

    build_on_rank_zero(build_if_needed, group, what=f"the {name} blend {path}")
    return np.load(path, mmap_mode="r"), path


def _loads_with_length(path, num_samples):
    try:
        return np.load(path, mmap_mode="r").shape == (num_samples,)
    except (OSError, ValueError):
        return False
