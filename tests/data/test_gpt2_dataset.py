import os
import pickle

import numpy as np
import pytest

import megatron.data.index_maps as index_maps
from megatron.data.gpt2_dataset import build_index_mappings_only, build_train_valid_test_datasets
from megatron.data.splits import parse_splits, split_document_ranges
from megatron.data.samplers import build_pretraining_data_loader
from megatron.data.index_maps import build_sample_idx, compute_index_maps, index_map_paths
from megatron.errors import DataError
from tests.data.fakes import write_token_dataset

# Token values encode (document, position) so any misplaced window is visible.
DOCS = [[100 * d + t for t in range(n)] for d, n in enumerate([3, 1, 4, 0, 5, 2, 7, 1])]


def _megatron_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Line-by-line port of Megatron's C++ helpers.build_sample_idx: the reference."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return out


@pytest.mark.parametrize("first_doc_length", [4, 0])
@pytest.mark.parametrize("seq_length", [1, 2, 4, 9, 40])
def test_sample_idx_matches_megatron_loop(seq_length, first_doc_length):
    rng = np.random.RandomState(3)
    sizes = rng.randint(0, 6, size=30).astype(np.int32)
    sizes[0] = first_doc_length
    documents = np.arange(30)
    doc_idx = np.tile(documents, 3)
    rng.shuffle(doc_idx)
    doc_idx = np.concatenate([[0], doc_idx])  # the stream starts with document 0
    tokens = int(sizes[doc_idx].sum())
    ours = build_sample_idx(sizes, doc_idx, seq_length, 1, tokens)
    np.testing.assert_array_equal(ours, _megatron_sample_idx(sizes, doc_idx, seq_length, 1, tokens))


def test_maps_follow_megatron_rng_order():
    sizes = np.array([len(d) for d in DOCS], dtype=np.int32)
    documents = np.arange(2, 7, dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx = compute_index_maps(documents, sizes, 20, 4, seed=1234)
    # Megatron: 18 tokens per epoch, so 5 epochs for 20 samples of 4 (+1) tokens; docs laid
    # out with mgrid; one RNG shuffles doc_idx, then shuffle_idx.
    rng = np.random.RandomState(seed=1234)
    expected_doc_idx = np.mgrid[0:5, 0:5][1]
    expected_doc_idx[:] = documents
    expected_doc_idx = expected_doc_idx.reshape(-1).astype(np.int32)
    rng.shuffle(expected_doc_idx)
    np.testing.assert_array_equal(doc_idx, expected_doc_idx)
    expected_shuffle = np.arange((5 * 18 - 1) // 4, dtype=np.uint32)
    rng.shuffle(expected_shuffle)
    np.testing.assert_array_equal(shuffle_idx, expected_shuffle)
    assert doc_idx.dtype == np.int32 and sample_idx.dtype == np.int32
    assert shuffle_idx.dtype == np.uint32


def test_samples_are_windows_of_the_document_stream_over_epochs(tmp_path):
    prefix = write_token_dataset(tmp_path / "corpus", DOCS)
    seq = 4
    train, valid, test = build_train_valid_test_datasets(prefix, "1", [30, 0, 0], seq, seed=7)
    assert valid is None and test is None
    tokens_per_epoch = sum(len(d) for d in DOCS)  # 23
    epochs = -(-(30 * seq + 1) // tokens_per_epoch)  # 6
    assert len(train) == (epochs * tokens_per_epoch - 1) // seq >= 30
    assert sorted(train.doc_idx) == sorted(list(range(len(DOCS))) * epochs)
    assert sorted(train.shuffle_idx) == list(range(len(train)))
    stream = np.concatenate([DOCS[d] for d in train.doc_idx])  # built by hand from doc order
    for i in range(len(train)):
        k = int(train.shuffle_idx[i])
        sample = train[i]["text"]
        assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
        np.testing.assert_array_equal(sample, stream[k * seq: k * seq + seq + 1])


@pytest.mark.parametrize("seq_length", [1, 4, 7, 23, 50])
def test_sample_counts_spanning_an_epoch_count_share_one_order(seq_length):
    """Every count in the range gives the same maps (the order a resume continues); the
    counts just outside it need another number of epochs, so another order."""
    sizes = np.array([len(d) for d in DOCS], dtype=np.int32)
    documents = np.arange(len(DOCS), dtype=np.int32)
    tokens = int(sizes.sum())
    for epochs in (1, 2, 5):
        fewest, most = index_maps.sample_counts_spanning(epochs, tokens, seq_length)
        if fewest > most:  # a sequence longer than an epoch: no count spans exactly this
            continue
        assert {index_maps.num_epochs_needed(tokens, seq_length, n)
                for n in range(fewest, most + 1)} == {epochs}
        assert index_maps.num_epochs_needed(tokens, seq_length, most + 1) > epochs
        if epochs > 1:
            assert index_maps.num_epochs_needed(tokens, seq_length, fewest - 1) < epochs
        fewest_maps = compute_index_maps(documents, sizes, fewest, seq_length, seed=3)
        most_maps = compute_index_maps(documents, sizes, most, seq_length, seed=3)
        for fewest_map, most_map in zip(fewest_maps, most_maps):
            np.testing.assert_array_equal(fewest_map, most_map)


def test_splits_use_contiguous_document_ranges(tmp_path):
    prefix = write_token_dataset(tmp_path / "corpus", DOCS)
    train, valid, test = build_train_valid_test_datasets(prefix, "6/1/1", [10, 5, 5], 3, seed=1)
    assert split_document_ranges("6/1/1", 8) == [0, 6, 7, 8]
    assert set(train.doc_idx) == set(range(6))
    assert set(valid.doc_idx) == {6} and set(test.doc_idx) == {7}
    valid_tokens = {t for i in range(len(valid)) for t in valid[i]["text"]}
    assert valid_tokens == set(DOCS[6])


def test_parse_and_split_strings():
    assert parse_splits("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_splits("8/2") == pytest.approx([0.8, 0.2, 0.0])
    assert parse_splits("1") == [1.0, 0.0, 0.0]
    assert split_document_ranges("949,50,1", 1000) == [0, 949, 999, 1000]
    assert split_document_ranges("1,1,1", 2) == [0, 0, 1, 2]  # Megatron's rounding shift
    bounds = split_document_ranges("0,1,1", 3)
    assert bounds[0] == 0 and bounds[-1] == 3 and bounds == sorted(bounds)
    for bad, why in [("a,b", "not a list of numbers"), ("1,2,3,4", "at most 3"),
                     ("0,0,0", "positive sum"), ("-1,2", "non-negative"), ("", "numbers")]:
        with pytest.raises(DataError, match=why):
            parse_splits(bad)


def test_zero_samples_or_empty_split_gives_none(tmp_path):
    prefix = write_token_dataset(tmp_path / "corpus", DOCS)
    train, valid, test = build_train_valid_test_datasets(prefix, "1,0,1", [4, 4, 0], 2, seed=1)
    assert train is not None and valid is None and test is None


def test_split_with_documents_but_no_tokens(tmp_path):
    prefix = write_token_dataset(tmp_path / "corpus", [[1, 2, 3], [], []])
    with pytest.raises(DataError, match="valid split .* holds no tokens"):
        build_train_valid_test_datasets(prefix, "1,2", [1, 1, 0], 2, seed=1)


def test_missing_data_prefix_says_how_to_build(tmp_path):
    with pytest.raises(DataError, match="tools/preprocess_data.py"):
        build_train_valid_test_datasets(str(tmp_path / "nope"), "1", [1, 0, 0], 2, seed=1)


def test_index_maps_are_cached_and_reused(tmp_path, monkeypatch):
    prefix = write_token_dataset(tmp_path / "corpus", DOCS)
    paths = build_index_mappings_only(prefix, "1", [12, 0, 0], 3, seed=5)
    assert paths == list(index_map_paths(prefix, "train", 12, 3, 5).values())
    assert os.path.basename(paths[0]) == "corpus_train_indexmap_12ns_3sl_5s_doc_idx.npy"
    first = build_train_valid_test_datasets(prefix, "1", [12, 0, 0], 3, seed=5)[0]
    samples = [first[i]["text"] for i in range(len(first))]

    def must_not_rebuild(*args):
        raise AssertionError("index maps were rebuilt although cached")

    monkeypatch.setattr(index_maps, "compute_index_maps", must_not_rebuild)
    again = build_train_valid_test_datasets(prefix, "1", [12, 0, 0], 3, seed=5)[0]
    for i, sample in enumerate(samples):
        np.testing.assert_array_equal(again[i]["text"], sample)
    monkeypatch.undo()
    # A rebuilt corpus (newer .idx) or a damaged cache file triggers a rebuild.
    os.utime(prefix + ".idx", (os.path.getmtime(paths[0]) + 10,) * 2)
    calls = []
    real = index_maps.compute_index_maps
    monkeypatch.setattr(index_maps, "compute_index_maps", lambda *a: calls.append(1) or real(*a))
    build_train_valid_test_datasets(prefix, "1", [12, 0, 0], 3, seed=5)
    np.save(paths[1], np.zeros((2, 2), dtype=np.int32))
    os.utime(paths[1], (os.path.getmtime(prefix + ".idx") + 10,) * 2)
    rebuilt = build_train_valid_test_datasets(prefix, "1", [12, 0, 0], 3, seed=5)[0]
    assert len(calls) == 2
    np.testing.assert_array_equal(rebuilt[3]["text"], samples[3])
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_dataset_pickles_and_feeds_a_loader_with_workers(tmp_path):
    prefix = write_token_dataset(tmp_path / "corpus", DOCS)
    train = build_train_valid_test_datasets(prefix, "1", [16, 0, 0], 4, seed=2)[0]
    clone = pickle.loads(pickle.dumps(train))
    expected = np.stack([train[i]["text"] for i in range(8)])
    np.testing.assert_array_equal(np.stack([clone[i]["text"] for i in range(8)]), expected)
    loader = build_pretraining_data_loader(train, consumed_samples=0, micro_batch_size=4,
                                           data_parallel_rank=0, data_parallel_size=1,
                                           num_workers=1)
    batches = [b["text"] for _, b in zip(range(2), loader)]
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in batches]), expected)


def test_index_maps_of_an_empty_dataset_or_train_split_are_an_error(tmp_path):
    empty = write_token_dataset(tmp_path / "empty", [])
    with pytest.raises(DataError, match="hold no documents"):
        build_index_mappings_only(empty, "1", [4, 0, 0], 2, seed=1)
    prefix = write_token_dataset(tmp_path / "corpus", DOCS)
    with pytest.raises(DataError, match="--split '0,1' leaves no training documents"):
        build_index_mappings_only(prefix, "0,1", [4, 4, 0], 2, seed=1)


def test_maps_cached_for_another_split_are_rebuilt_not_reused(tmp_path):
    """The cache names (Megatron's) say split name, samples, length and seed, not which
    documents: after --split 4,2,2 the valid maps of --split 5,2,1 have the same shapes (two
    documents of four tokens), and reusing them validated on training documents."""
    prefix = write_token_dataset(tmp_path / "corpus", [[d] * 4 for d in range(8)])
    valid = build_train_valid_test_datasets(prefix, "4,2,2", [4, 4, 4], 3, seed=1)[1]
    assert set(valid.doc_idx) == {4, 5}
    valid = build_train_valid_test_datasets(prefix, "5,2,1", [4, 4, 4], 3, seed=1)[1]
    assert set(valid.doc_idx) == {5, 6}
    assert {int(t) for i in range(len(valid)) for t in valid[i]["text"]} == {5, 6}
