"""A weighted blend of several datasets: `--data-path 0.3 A 0.7 B`, as Megatron-LM 2.x and
later take it (or `--data-path A B`, weighted by each dataset's tokens, as Megatron-core).

Each dataset is cut by --split and sampled as alone (its own index maps, for at least its
share of the samples plus 0.5%, Megatron-LM's margin); sample i of a split's blend is the
next unserved sample of the dataset furthest behind its share after i samples, the first on
ties (the rule of Megatron-LM's build_blending_indices), so that after any number of samples
every dataset's count is within two of its share. That per-sample choice (and which sample of
its dataset each one is) is computed once per blend and sample count, on rank 0, and cached
beside the first dataset, where every rank maps it from.
"""

import hashlib
import json
import os
import time

import numpy as np
import torch

from megatron.errors import DataError

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
    """Sample i is sample `within[i]` of dataset `choices[i]` (cached_choices)."""

    def __init__(self, name, datasets, choices, within, paths):
        self.name, self.datasets = name, list(datasets)
        self.choices, self.within = choices, within
        self.map_paths = list(paths) + [p for d in self.datasets for p in d.map_paths]

    @property
    def num_epochs(self):
        """Each dataset's epochs: its own maps shuffle all of them together, so another
        count reorders that dataset's samples."""
        return [dataset.num_epochs for dataset in self.datasets]

    def __len__(self):
        return len(self.choices)

    def __getitem__(self, idx):
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.name} sample {idx} out of range (length {len(self)})")
        return self.datasets[int(self.choices[idx])][int(self.within[idx])]


def cached_choices(name, prefixes, weights, num_samples, group=None):
    """(choices, within, their two .npy paths): blending_choices and samples_within, cached
    beside the first dataset (rank 0 of `group` builds them) and mapped from there."""
    from megatron.data.index_maps import save_atomic
    from megatron.data.rank_zero import build_on_rank_zero, log_rank_zero
    key = json.dumps([[os.path.realpath(p), w] for p, w in zip(prefixes, weights)])
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    base = f"{prefixes[0]}_{name}_blend_{digest}_{num_samples}ns"
    paths = (f"{base}_choices.npy", f"{base}_within.npy")

    def build_if_needed():
        if all(_loads_with_length(path, num_samples) for path in paths):
            return
        start = time.perf_counter()
        choices = blending_choices(weights, num_samples)
        save_atomic(paths[1], samples_within(choices, len(prefixes)))
        save_atomic(paths[0], choices)
        log_rank_zero(f" > built the {name} blend of {len(prefixes)} datasets in "
                      f"{time.perf_counter() - start:.2f} s: {num_samples} samples ({base}_*)")

    build_on_rank_zero(build_if_needed, group, what=f"the {name} blend {base}_*")
    if not all(_loads_with_length(path, num_samples) for path in paths):
        raise DataError(f"the {name} blend {base}_* is unusable after rank 0 built it. Is "
                        f"{os.path.dirname(os.path.abspath(base))} on a filesystem shared by "
                        "all ranks?")
    return (*(np.load(path, mmap_mode="r") for path in paths), paths)


def _loads_with_length(path, num_samples):
    try:
        return np.load(path, mmap_mode="r").shape == (num_samples,)
    except (OSError, ValueError):
        return False
