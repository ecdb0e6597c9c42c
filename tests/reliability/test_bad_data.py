"""Damaged data files stop the trainer with one clear line that names the file."""

import shutil

import numpy as np
import pytest

import pretrain_gpt2
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import DataError
from tests.reliability.harness import trainer_argv

HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, item count, document count


def _copy(corpus, tmp_path):
    prefix = tmp_path / "copy"
    for ext in (".bin", ".idx"):
        shutil.copyfile(corpus["prefix"] + ext, str(prefix) + ext)
    return prefix


def _counts(idx):
    data = idx.read_bytes()
    return (int(np.frombuffer(data, np.int64, 1, 18)[0]),
            int(np.frombuffer(data, np.int64, 1, 26)[0]))


def _truncate_bin(prefix):
    path = prefix.with_suffix(".bin")
    path.write_bytes(path.read_bytes()[:1000])
    return path


def _truncate_idx(prefix):
    path = prefix.with_suffix(".idx")
    path.write_bytes(path.read_bytes()[:200])
    return path


def _garble_idx(prefix):
    path = prefix.with_suffix(".idx")
    data = bytearray(path.read_bytes())
    data[:9] = b"GARBAGE!!"
    path.write_bytes(bytes(data))
    return path


def _document_index_past_the_end(prefix):
    path = prefix.with_suffix(".idx")
    items, docs = _counts(path)
    data = bytearray(path.read_bytes())
    last_doc = HEADER + items * 12 + (docs - 1) * 8
    data[last_doc:last_doc + 8] = np.int64(items + 50).tobytes()
    path.write_bytes(bytes(data))
    return path


def _item_pointer_past_the_end(prefix):
    path = prefix.with_suffix(".idx")
    items, _ = _counts(path)
    data = bytearray(path.read_bytes())
    middle = HEADER + items * 4 + (items // 2) * 8
    data[middle:middle + 8] = np.int64(10 ** 9).tobytes()
    path.write_bytes(bytes(data))
    return path


def _empty_corpus(prefix):
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    builder = MMapIndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    builder.finalize(str(prefix) + ".idx")
    return prefix.with_suffix(".idx")


DAMAGE = {"truncated .bin": (_truncate_bin, "truncated"),
          "truncated .idx": (_truncate_idx, "truncated"),
          "not an index": (_garble_idx, "not an MMIDIDX index"),
          "document index past the end": (_document_index_past_the_end, "document"),
          "item pointer past the end": (_item_pointer_past_the_end, "starts at byte 1000000000"),
          "empty corpus": (_empty_corpus, "empty")}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_dataset_is_a_clear_error_naming_the_file(corpus, tmp_path, damage):
    prefix = _copy(corpus, tmp_path)
    make, words = DAMAGE[damage]
    path = make(prefix)
    with pytest.raises(DataError, match=words) as error:
        dataset = MMapIndexedDataset(str(prefix))
        for i in range(len(dataset)):  # some damage shows only when an item is read
            dataset[i]
        if len(dataset) == 0:
            raise DataError(f"{prefix}: empty")  # the trainer's check is tested below
    assert str(path.parent) in str(error.value) and path.stem in str(error.value)


@pytest.mark.parametrize("damage", ["truncated .bin", "document index past the end",
                                    "empty corpus"])
def test_the_trainer_stops_with_one_line(corpus, tmp_path, capsys, damage):
    prefix = _copy(corpus, tmp_path)
    path = DAMAGE[damage][0](prefix)
    corpus = dict(corpus, prefix=str(prefix))
    assert pretrain_gpt2.main(trainer_argv(corpus, tmp_path / "log", 2)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert str(prefix) in err or str(path) in err, err
