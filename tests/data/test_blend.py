"""Blends of several datasets (`--data-path 0.3 A 0.7 B`, or `A B` by their tokens): the
choice of dataset per sample keeps every dataset within two samples of its share at every
point; each sample is its dataset's own, in its own order; the splits blend the datasets that
have documents in them; the choices are cached; the index-map tool builds everything."""

import numpy as np
import pytest

from megatron.data.blend import blending_choices, samples_within
from megatron.data.gpt2_dataset import (GPT2Dataset, build_index_mappings_only,
                                        build_train_valid_test_datasets, indexed_datasets)
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.data.fakes import write_token_dataset

SEQ, SEED = 4, 7


def _corpus(prefix, first_token, num_docs=12):
    """Documents whose tokens say which corpus (first_token) and document they come from."""
    rng = np.random.RandomState(first_token)
    docs = [[first_token + 10 * d + t for t in range(rng.randint(3, 9))] for d in range(num_docs)]
    return write_token_dataset(prefix, docs)


@pytest.fixture
def corpora(tmp_path):
    return _corpus(tmp_path / "a", 1000), _corpus(tmp_path / "b", 5000, num_docs=20)


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.3, 0.7), (0.05, 0.15, 0.8),
                                     (0.2, 0.2, 0.2, 0.2, 0.2)])
def test_every_dataset_stays_within_two_samples_of_its_share(weights):
    choices = blending_choices(weights, 5000)
    counts = np.zeros(len(weights))
    for sample, chosen in enumerate(choices, start=1):
        counts[chosen] += 1
        assert np.all(np.abs(counts - np.array(weights) * sample) < 2), sample
    assert choices[0] == int(np.argmax(weights))  # the furthest behind first; ties: the first
    within = samples_within(choices, len(weights))
    for d in range(len(weights)):  # each dataset's samples in its own order
        assert list(within[choices == d]) == list(range(int(np.sum(choices == d))))


@pytest.mark.parametrize("weights, expected", [
    ((0.2, 0.3, 0.5), [2, 1, 0, 2, 1, 2, 0, 2, 1, 2, 0, 2]),
    ((0.1, 0.45, 0.45), [1, 2, 0, 1, 2, 1, 2, 1, 2, 1, 2, 0]),
])
def test_the_choices_follow_megatrons_rule(weights, expected):
    """Sample s goes to the dataset with the largest weight x max(s, 1) - samples so far,
    the first on ties (worked by hand for the first: s=0 and s=1 both count as 1)."""
    assert blending_choices(weights, 12).tolist() == expected


def test_each_sample_is_its_datasets_own_in_its_order(corpora):
    a, b = corpora
    train, valid, test = build_train_valid_test_datasets(["0.3", a, "0.7", b], "8,2,0",
                                                         [40, 10, 0], SEQ, SEED)
    assert test is None and len(train) == 40 and len(valid) == 10
    for blend in (train, valid):
        counts = np.bincount(blend.choices, minlength=2)
        assert abs(counts[0] - 0.3 * len(blend)) < 2 and abs(counts[1] - 0.7 * len(blend)) < 2
        served = [0, 0]
        for i in range(len(blend)):
            d = int(blend.choices[i])
            alone = blend.datasets[d]
            assert np.array_equal(blend[i]["text"], alone[served[d]]["text"])
            served[d] += 1
    # a dataset samples as it would alone: the same maps, for its share plus 0.5%
    alone = build_train_valid_test_datasets(a, "8,2,0", [int(np.ceil(40 * 0.3 * 1.005)), 0, 0],
                                            SEQ, SEED)[0]
    first = train.datasets[0]
    assert [first[k]["text"].tolist() for k in range(12)] == \
        [alone[k]["text"].tolist() for k in range(12)]
    assert {int(t) // 1000 for k in range(len(train)) for t in train[k]["text"]} == {1, 5}
    assert [ds.indexed_dataset.prefix for ds in train.datasets] == [a, b]
    assert [ds.prefix for ds in indexed_datasets(train)] == [a, b]


def test_without_weights_each_dataset_counts_by_its_tokens_in_the_split(corpora):
    a, b = corpora
    train = build_train_valid_test_datasets([a, b], "1", [200, 0, 0], SEQ, SEED)[0]
    tokens = [int(np.sum(MMapIndexedDataset(p).sizes)) for p in (a, b)]
    counts = np.bincount(train.choices, minlength=2)
    for count, share in zip(counts, np.array(tokens) / sum(tokens)):
        assert abs(count - share * 200) < 2


def test_a_split_blends_the_datasets_with_documents_in_it(tmp_path):
    """`--split 9,1` over 12 documents leaves the small corpus no validation documents (of 3):
    validation draws from the other alone, its weight renormalized."""
    a = _corpus(tmp_path / "a", 1000, num_docs=3)
    b = _corpus(tmp_path / "b", 5000, num_docs=20)
    train, valid, _ = build_train_valid_test_datasets(["0.5", a, "0.5", b], "9,1", [20, 8, 0],
                                                      SEQ, SEED)
    assert len(train.datasets) == 2
    assert len(valid.datasets) == 1 and valid.datasets[0].indexed_dataset.prefix == b
    assert len(valid) == 8 and set(valid.choices.tolist()) == {0}


def test_the_choices_are_cached_and_the_tool_lists_them(corpora, capsys):
    a, b = corpora
    build_train_valid_test_datasets(["0.3", a, "0.7", b], "1", [30, 0, 0], SEQ, SEED)
    assert "built the train blend of 2 datasets" in capsys.readouterr().out
    train = build_train_valid_test_datasets(["0.3", a, "0.7", b], "1", [30, 0, 0], SEQ, SEED)[0]
    assert "built the train blend" not in capsys.readouterr().out  # read from the cache
    paths = build_index_mappings_only(["0.3", a, "0.7", b], "1", [30, 0, 0], SEQ, SEED)
    assert paths == train.map_paths and paths[0].endswith("_30ns_choices.npy")
    assert paths[1].endswith("_30ns_within.npy")
    assert len(paths) == 2 + 2 * 3  # the choices, which sample of its dataset, three maps each
    other = build_train_valid_test_datasets(["0.7", a, "0.3", b], "1", [30, 0, 0], SEQ, SEED)[0]
    assert other.map_paths[0] != paths[0]  # other weights: another cache file
    assert isinstance(other.datasets[0], GPT2Dataset)


def test_each_split_can_read_all_of_its_own_datasets(corpora, tmp_path):
    """--train-data-path / --valid-data-path / --test-data-path: no --split; a split without
    its own path has no dataset."""
    a, b = corpora
    c = _corpus(tmp_path / "c", 9000, num_docs=5)
    train, valid, test = build_train_valid_test_datasets(
        None, None, [30, 10, 4], SEQ, SEED, split_data_paths=(["0.5", a, "0.5", b], [c], None))
    assert test is None
    assert [d.indexed_dataset.prefix for d in train.datasets] == [a, b]
    assert len(train.datasets[0].doc_idx) % 12 == 0 and sorted(set(train.datasets[0].doc_idx)) \
        == list(range(12))  # every document of a, none held back
    assert isinstance(valid, GPT2Dataset) and valid.indexed_dataset.prefix == c
    assert sorted(set(valid.doc_idx)) == list(range(5))
    assert {int(t) // 1000 for k in range(len(valid)) for t in valid[k]["text"]} == {9}
    paths = build_index_mappings_only(None, None, [30, 10, 4], SEQ, SEED,
                                      split_data_paths=([a, b], [c], None))
    assert any("_valid_indexmap_10ns_" in p and p.startswith(c) for p in paths)


def test_a_dataset_whose_split_holds_no_tokens_has_no_share_of_an_unweighted_blend(tmp_path):
    a = write_token_dataset(tmp_path / "a", [[1000 + t for t in range(6)]] * 9 + [[]])
    b = _corpus(tmp_path / "b", 5000, num_docs=20)
    _, valid, _ = build_train_valid_test_datasets([a, b], "9,1", [20, 6, 0], SEQ, SEED)
    assert [d.indexed_dataset.prefix for d in valid.datasets] == [b]
