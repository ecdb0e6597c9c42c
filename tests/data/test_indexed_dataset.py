import os
import pickle
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (DTYPES, MMapIndexedDataset, MMapIndexedDatasetBuilder,
                                           best_dtype, data_file_path, dtype_code,
                                           index_file_path)
from megatron.errors import DataError
from tests.data.fakes import write_token_dataset


def test_tiny_index_has_megatron_byte_layout(tmp_path):
    prefix = str(tmp_path / "tiny")
    with MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        builder.add_item([1, 2, 3])
        builder.add_item([4])
        builder.end_document()
        builder.add_item([5, 6])
        builder.end_document()
        builder.finalize(prefix + ".idx")
    expected_idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                    + struct.pack("<Q", 3) + struct.pack("<Q", 3)
                    + struct.pack("<3i", 3, 1, 2)          # sizes
                    + struct.pack("<3q", 0, 6, 8)          # byte pointers
                    + struct.pack("<3q", 0, 2, 3))         # doc_idx
    assert open(prefix + ".idx", "rb").read() == expected_idx
    assert open(prefix + ".bin", "rb").read() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)
    assert sorted(os.listdir(tmp_path)) == ["tiny.bin", "tiny.idx"]  # no temp files left


def test_dtype_codes_and_best_dtype():
    assert {code: np.dtype(d).name for code, d in DTYPES.items()} == {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
        8: "uint16"}
    assert dtype_code(np.uint16) == 8 and dtype_code(np.int32) == 4 and dtype_code("float64") == 6
    assert best_dtype(50257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(250000) == np.int32


def _read_by_hand(prefix):
    """Parse .idx with struct and slice .bin with a plain np.memmap: an independent reader."""
    raw = open(prefix + ".idx", "rb").read()
    _, _, code, n, d = struct.unpack_from("<9sQBQQ", raw)
    sizes = struct.unpack_from(f"<{n}i", raw, 34)
    pointers = struct.unpack_from(f"<{n}q", raw, 34 + 4 * n)
    doc_idx = struct.unpack_from(f"<{d}q", raw, 34 + 12 * n)
    data = np.memmap(prefix + ".bin", dtype=DTYPES[code], mode="r")
    itemsize = np.dtype(DTYPES[code]).itemsize
    items = [np.array(data[p // itemsize: p // itemsize + s]) for p, s in zip(pointers, sizes)]
    return items, list(doc_idx)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_round_trip_matches_independent_reader(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=rng.integers(0, 50)) for _ in range(40)]
    prefix = write_token_dataset(tmp_path / "rt", docs, dtype)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 40 and ds.dtype == np.dtype(dtype)
    items, doc_idx = _read_by_hand(prefix)
    assert doc_idx == list(range(41)) and list(ds.doc_idx) == doc_idx
    assert list(ds.sizes) == [len(d) for d in docs]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        np.testing.assert_array_equal(items[i], doc)
    np.testing.assert_array_equal(ds[-1], docs[-1])
    assert [list(x) for x in ds[3:6]] == [list(d) for d in docs[3:6]]
    long_doc = next(i for i, d in enumerate(docs) if len(d) > 10)
    np.testing.assert_array_equal(ds.get(long_doc, offset=2, length=5), docs[long_doc][2:7])
    np.testing.assert_array_equal(ds.get(long_doc, offset=4), docs[long_doc][4:])
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[long_doc], docs[long_doc])
    warm = MMapIndexedDataset(prefix, skip_warmup=False)
    np.testing.assert_array_equal(warm[long_doc], docs[long_doc])


def test_empty_dataset_round_trips(tmp_path):
    prefix = write_token_dataset(tmp_path / "empty", [])
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 0 and list(ds.doc_idx) == [0]


def test_merge_file_appends_items_and_documents(tmp_path):
    a_docs = [[1, 2], [3], [4, 5, 6]]
    b_docs = [[7], [8, 9]]
    a = write_token_dataset(tmp_path / "a", a_docs)
    b = write_token_dataset(tmp_path / "b", b_docs)
    merged = str(tmp_path / "merged")
    with MMapIndexedDatasetBuilder(merged + ".bin", np.uint16) as builder:
        builder.add_item([42])
        builder.end_document()
        builder.merge_file_(a)
        builder.merge_file_(b)
        builder.finalize(merged + ".idx")
    ds = MMapIndexedDataset(merged)
    assert [list(x) for x in ds] == [[42]] + a_docs + b_docs
    assert list(ds.doc_idx) == [0, 1, 2, 3, 4, 5, 6]
    assert open(merged + ".bin", "rb").read() == struct.pack("<10H", 42, 1, 2, 3, 4, 5, 6, 7, 8, 9)


def test_merge_rejects_other_dtype(tmp_path):
    a = write_token_dataset(tmp_path / "a", [[1, 2]], np.int32)
    with MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16) as builder:
        with pytest.raises(DataError, match="cannot merge"):
            builder.merge_file_(a)
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]  # the failed build left nothing


def test_failed_build_leaves_previous_dataset_and_no_temp_files(tmp_path):
    prefix = write_token_dataset(tmp_path / "keep", [[1, 2, 3]])
    with pytest.raises(RuntimeError):
        with MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
            builder.add_item([9, 9])
            raise RuntimeError("crash mid-build")
    assert sorted(os.listdir(tmp_path)) == ["keep.bin", "keep.idx"]
    assert list(MMapIndexedDataset(prefix)[0]) == [1, 2, 3]


def test_token_too_large_for_dtype(tmp_path):
    with MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16) as builder:
        with pytest.raises(DataError, match="70000 does not fit"):
            builder.add_item([1, 70000])


@pytest.fixture
def good(tmp_path):
    return write_token_dataset(tmp_path / "good", [[1, 2, 3], [4, 5]])


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file(good, missing):
    os.remove(good + missing)
    with pytest.raises(DataError) as e:
        MMapIndexedDataset(good)
    assert good + missing in str(e.value)
    assert "python tools/preprocess_data.py --input" in str(e.value)
    assert "--output-prefix" in str(e.value)


def test_prefix_given_with_extension(good):
    with pytest.raises(DataError, match="drop the .bin extension: --data-path .*good$"):
        MMapIndexedDataset(good + ".bin")


def test_the_output_prefix_given_for_the_dataset_names_the_dataset(tmp_path):
    """preprocess_data.py --output-prefix data/corpus writes data/corpus_text_document."""
    written = write_token_dataset(tmp_path / "corpus_text_document", [[1, 2]])
    with pytest.raises(DataError, match=r"names its outputs --output-prefix \+ _<json key>"
                                        r"_document: --data-path .*corpus_text_document$"):
        MMapIndexedDataset(str(tmp_path / "corpus"))
    from megatron.data.corpora import resolve_corpus
    with pytest.raises(DataError, match=r"--train-data .* is a tokenized dataset \(.bin/.idx\); "
                                        r"train on it with --data-path .*corpus_text_document "):
        resolve_corpus(written)


def test_wrong_magic(good):
    with open(good + ".idx", "r+b") as f:
        f.write(b"GARBAGE!!")
    with pytest.raises(DataError, match="not an MMIDIDX index") as e:
        MMapIndexedDataset(good)
    assert good + ".idx" in str(e.value)


def test_legacy_tntidx_is_named(good):
    with open(good + ".idx", "wb") as f:
        f.write(b"TNTIDX\x00\x00" + struct.pack("<QQQQQQ", 1, 8, 2, 2, 2, 1) + bytes(64))
    with pytest.raises(DataError, match="legacy TNTIDX") as e:
        MMapIndexedDataset(good)
    assert "--dataset-impl mmap" in str(e.value)


@pytest.mark.parametrize("keep_bytes", [5, 20, 40, 60])
def test_truncated_index(good, keep_bytes):
    raw = open(good + ".idx", "rb").read()
    assert len(raw) == 34 + 2 * 12 + 3 * 8
    with open(good + ".idx", "wb") as f:
        f.write(raw[:keep_bytes])
    with pytest.raises(DataError, match="truncated") as e:
        MMapIndexedDataset(good)
    assert good + ".idx" in str(e.value)


def test_bin_shorter_or_longer_than_index(good):
    raw = open(good + ".bin", "rb").read()
    with open(good + ".bin", "wb") as f:
        f.write(raw[:-2])
    with pytest.raises(DataError, match="shorter than its index says") as e:
        MMapIndexedDataset(good)
    assert good + ".bin" in str(e.value)
    with open(good + ".bin", "wb") as f:
        f.write(raw + b"\x00\x00")
    with pytest.raises(DataError, match="longer than its index says"):
        MMapIndexedDataset(good)


def test_unknown_dtype_code_and_version(good):
    raw = bytearray(open(good + ".idx", "rb").read())
    bad_code = raw[:17] + bytes([99]) + raw[18:]
    open(good + ".idx", "wb").write(bad_code)
    with pytest.raises(DataError, match="unknown dtype code 99"):
        MMapIndexedDataset(good)
    bad_version = raw[:9] + struct.pack("<Q", 2) + raw[17:]
    open(good + ".idx", "wb").write(bad_version)
    with pytest.raises(DataError, match="version 2"):
        MMapIndexedDataset(good)


def test_index_past_the_end(good):
    ds = MMapIndexedDataset(good)
    with pytest.raises(DataError, match="item index 2 is out of range; the dataset has 2"):
        ds[2]
    with pytest.raises(IndexError):  # also an IndexError, so plain iteration stops
        ds.get(-3)
    with pytest.raises(DataError, match="item 0 has 3 tokens; cannot read 2 tokens at offset 2"):
        ds.get(0, offset=2, length=2)
    assert [list(x) for x in ds] == [[1, 2, 3], [4, 5]]


# good: 2 items of sizes [3, 2] (uint16), pointers [0, 6], document index [0, 1, 2].
# Layout: 34-byte header, then int32 sizes, int64 pointers, int64 document index.
@pytest.mark.parametrize("offset, fmt, value, message", [
    (34 + 4, "<i", -2, "item 1 has a negative size \\(-2\\)"),
    (34 + 2 * 4, "<q", 6, "item 0 starts at byte 6 of the .bin, but the items before it end "
                          "at byte 0"),
    (34 + 2 * 4 + 8, "<q", 2, "item 1 starts at byte 2 .* end at byte 6 .*back to back"),
    (34 + 2 * 4, "<q", -8, "item 0 starts at byte -8"),
    (34 + 2 * 12 + 2 * 8, "<q", 1, "runs from item 0 to 1, but must cover items 0 to 2 "
                                   "\\(it disagrees with the sizes\\)"),
    (34 + 2 * 12, "<q", 1, "runs from item 1 to 2"),
    (34 + 2 * 12 + 8, "<q", 3, "document boundary 1 points at item 3, outside its 2 items"),
])
def test_inconsistent_index_is_refused_when_opened(good, offset, fmt, value, message):
    raw = bytearray(open(good + ".idx", "rb").read())
    struct.pack_into(fmt, raw, offset, value)
    open(good + ".idx", "wb").write(bytes(raw))
    with pytest.raises(DataError, match=message + ".*the file is corrupt. Rebuild it"):
        MMapIndexedDataset(good)


def test_index_checks_span_chunks(tmp_path):
    """The back-to-back check carries the running offset across its chunks of items."""
    from megatron.data.indexed_dataset import _Index
    prefix = write_token_dataset(tmp_path / "many", [[1] * (i % 5 + 1) for i in range(100)])
    _Index(prefix + ".idx")._check_items(chunk=7)  # consistent: passes
    raw = bytearray(open(prefix + ".idx", "rb").read())
    struct.pack_into("<q", raw, 34 + 100 * 4 + 50 * 8, 0)  # item 50 back at byte 0
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(DataError, match="item 50 starts at byte 0"):
        _Index(prefix + ".idx")._check_items(chunk=7)


def test_paths(tmp_path):
    assert data_file_path("a/b_text_document") == "a/b_text_document.bin"
    assert index_file_path("a/b_text_document") == "a/b_text_document.idx"
