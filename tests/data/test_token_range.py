"""The dataset's largest token id: computed once, cached beside the index, checked."""

import os

import pytest

import megatron.data.token_range as token_range
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import DataError
from tests.data.fakes import write_token_dataset


def _scans(monkeypatch):
    calls = []
    real = token_range._scan

    def counting(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(token_range, "_scan", counting)
    return calls


def test_largest_id_is_cached_until_the_bin_changes(tmp_path, monkeypatch):
    calls = _scans(monkeypatch)
    monkeypatch.setattr(token_range, "_SCAN_BYTES", 4)  # several pieces
    prefix = write_token_dataset(tmp_path / "d", [[1, 2, 3], [700, 5], [6]])
    assert token_range.max_token_id(MMapIndexedDataset(prefix)) == 700
    assert token_range.max_token_id(MMapIndexedDataset(prefix)) == 700
    assert len(calls) == 1 and os.path.exists(token_range.cache_path(prefix))
    write_token_dataset(tmp_path / "d", [[9, 8]])  # rebuilt: another size
    assert token_range.max_token_id(MMapIndexedDataset(prefix)) == 9 and len(calls) == 2


def test_a_read_only_folder_still_gets_the_check(tmp_path, monkeypatch):
    prefix = write_token_dataset(tmp_path / "d", [[3, 4]])
    monkeypatch.setattr(token_range, "_write_cache", lambda path, value: None)
    assert token_range.max_token_id(MMapIndexedDataset(prefix)) == 4
    assert not os.path.exists(token_range.cache_path(prefix))


def test_ids_beyond_the_vocabulary_are_one_clear_error(tmp_path):
    dataset = MMapIndexedDataset(write_token_dataset(tmp_path / "d", [[1, 2], [512]]))
    token_range.check_token_ids(dataset, 513, 500)  # 512 fits a 513-entry vocabulary
    with pytest.raises(DataError, match=r"d.bin holds token id 512, but the model's vocabulary "
                                        r"has 512 entries \(the tokenizer's 500, padded\)"):
        token_range.check_token_ids(dataset, 512, 500)


def test_an_empty_dataset_has_no_largest_id(tmp_path):
    assert token_range.max_token_id(MMapIndexedDataset(write_token_dataset(tmp_path / "e", []))) \
        == -1
