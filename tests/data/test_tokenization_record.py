"""The record beside a tokenized dataset: written by every tokenization, checked by training."""

import json

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
from megatron.data.tokenization_record import (check_dataset_tokenization, read_record,
                                               record_path, tokenizer_identity)
from megatron.errors import DataError, TokenizerError
from tests.data.fakes import (ByteTokenizer, ShiftedByteTokenizer, WideTokenizer,
                              write_loose_json, write_token_dataset)

TEXTS = ["first document", "second one", "third, a bit longer than the others"]


def tokenized(tmp_path, tokenizer, append_eod=True, name="corpus"):
    source = write_loose_json(tmp_path / f"{name}.json", [{"text": t} for t in TEXTS])
    outputs, _ = tokenize_loose_json(source, str(tmp_path / name), ConstantFactory(tokenizer),
                                     append_eod=append_eod)
    return source, MMapIndexedDataset(outputs["text"])


def test_every_tokenization_records_its_source_and_tokenizer(tmp_path, capsys):
    source, dataset = tokenized(tmp_path, ByteTokenizer())
    record = read_record(dataset.prefix)
    assert record["source"] == source and record["json_key"] == "text"
    assert record["append_eod"] is True
    assert {k: record[k] for k in ("tokenizer", "vocab_size", "eod")} == \
        {"tokenizer": "ByteTokenizer", "vocab_size": 257, "eod": 256}
    check_dataset_tokenization(dataset, ByteTokenizer())
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("other, says", [
    (ShiftedByteTokenizer(), "splits text differently though vocab size and eod agree"),
    (WideTokenizer(), "this run's tokenizer is WideTokenizer (vocab 70000, eod 69999)"),
], ids=["same-size-other-ids", "other-vocab"])
def test_another_tokenizer_is_one_clear_error(tmp_path, other, says):
    _, dataset = tokenized(tmp_path, ByteTokenizer())
    with pytest.raises(DataError) as error:
        check_dataset_tokenization(dataset, other)
    message = str(error.value)
    assert "corpus_text_document.bin was tokenized by ByteTokenizer (vocab 257, eod 256)" \
        in message
    assert says in message and "tools/preprocess_data.py" in message


def test_a_dataset_without_eod_is_said_once(tmp_path, capsys):
    _, dataset = tokenized(tmp_path, ByteTokenizer(), append_eod=False)
    assert read_record(dataset.prefix)["append_eod"] is False
    check_dataset_tokenization(dataset, ByteTokenizer())
    out = capsys.readouterr().out
    assert out.count("note: ") == 1
    assert "carry no end-of-document token (it was tokenized without --append-eod)" in out


def test_a_dataset_made_elsewhere_is_checked_for_boundaries_from_its_documents(tmp_path,
                                                                                capsys):
    with_eod = MMapIndexedDataset(write_token_dataset(tmp_path / "a", [[5, 6, 256], [7, 256]]))
    check_dataset_tokenization(with_eod, ByteTokenizer())
    assert capsys.readouterr().out == ""
    without = MMapIndexedDataset(write_token_dataset(tmp_path / "b", [[5, 6, 7], [7, 8]]))
    check_dataset_tokenization(without, ByteTokenizer())
    out = capsys.readouterr().out
    assert "none of its first 2 documents ends with this tokenizer's end-of-document id 256" \
        in out


def test_a_failed_rebuild_leaves_no_old_record_vouching(tmp_path):
    source, dataset = tokenized(tmp_path, ByteTokenizer())
    write_loose_json(source, [], raw_lines=[b"not json"])
    with pytest.raises(DataError, match="no usable documents"):
        tokenize_loose_json(source, str(tmp_path / "corpus"), ConstantFactory(ShiftedByteTokenizer()))
    assert not (tmp_path / "corpus_text_document.source.json").exists()
    assert record_path(dataset.prefix) == str(tmp_path / "corpus_text_document.source.json")


def test_a_record_that_is_not_one_counts_as_none(tmp_path):
    _, dataset = tokenized(tmp_path, ByteTokenizer())
    with open(record_path(dataset.prefix), "w") as f:
        json.dump([1, 2], f)
    assert read_record(dataset.prefix) is None
    with open(record_path(dataset.prefix), "w") as f:
        f.write("{truncated")
    assert read_record(dataset.prefix) is None
    check_dataset_tokenization(dataset, WideTokenizer())  # no record: only the boundary check


class _PartialByteVocabulary(ByteTokenizer):
    def tokenize(self, text):
        if not text.isascii():
            raise TokenizerError("a byte symbol is missing from the vocabulary")
        return super().tokenize(text)


def test_a_tokenizer_that_cannot_tokenize_the_probe_still_has_an_identity():
    identity = tokenizer_identity(_PartialByteVocabulary())
    assert identity["probe_sha1"] is None and identity["vocab_size"] == 257


def test_a_record_of_other_files_is_stale_and_counts_as_none(tmp_path, capsys):
    """.bin/.idx rewritten by a tool that writes no record (Megatron-LM's own, or copied
    over): the old record no longer vouches for them, either way."""
    _, dataset = tokenized(tmp_path, ByteTokenizer())
    assert read_record(dataset.prefix) is not None
    write_token_dataset(dataset.prefix, [[3, 4, 256], [5, 256]])
    assert read_record(dataset.prefix) is None
    check_dataset_tokenization(MMapIndexedDataset(dataset.prefix), ShiftedByteTokenizer())
    # (its documents end with eod 256: no boundary note), and the record is said to be stale
    assert capsys.readouterr().out == (f" note: {record_path(dataset.prefix)} was written for "
                                       "other .bin/.idx files than these (rebuilt by a tool "
                                       "that writes no record?): the tokenizer they were made "
                                       "with is not checked; delete it, or rebuild the dataset "
                                       "with tools/preprocess_data.py\n")


def test_a_copy_keeps_its_record(tmp_path):
    """`cp` (no -a) gives the files new modification times: the record still names them,
    and another tokenizer is still the error. A record written before stamps hashed the
    files ([size, mtime]) still reads, by the sizes."""
    import os
    import shutil
    _, dataset = tokenized(tmp_path, ByteTokenizer())
    (tmp_path / "copy").mkdir()
    for suffix in (".bin", ".idx", ".source.json"):
        shutil.copyfile(dataset.prefix + suffix, str(tmp_path / "copy" / "c") + suffix)
        os.utime(str(tmp_path / "copy" / "c") + suffix, (1, 1))
    copied = MMapIndexedDataset(str(tmp_path / "copy" / "c"))
    assert read_record(copied.prefix) is not None
    with pytest.raises(DataError, match="splits text differently"):
        check_dataset_tokenization(copied, ShiftedByteTokenizer())
    with open(record_path(dataset.prefix)) as f:
        old = json.load(f)
    old["dataset_files"] = {ext: [os.path.getsize(f"{dataset.prefix}.{ext}"),
                                  os.stat(f"{dataset.prefix}.{ext}").st_mtime_ns]
                            for ext in ("bin", "idx")}
    with open(record_path(dataset.prefix), "w") as f:
        json.dump(old, f)
    assert read_record(dataset.prefix)["tokenizer"] == "ByteTokenizer"
    os.utime(dataset.prefix + ".bin", (1, 1))  # copied with such a record: its sizes decide
    assert read_record(dataset.prefix)["tokenizer"] == "ByteTokenizer"


def test_boundaries_are_sampled_at_document_ends_not_sentence_ends(tmp_path, capsys):
    """A sentence-split dataset: several items per document, eod (when there is one) only
    after the last; the note counts documents."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    def sentences(name, eod):
        prefix = str(tmp_path / name)
        with MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
            for document in ([[5, 6], [7] + eod], [[8, 9], [10], [11] + eod]):
                for sentence in document:
                    builder.add_item(np.asarray(sentence))
                builder.end_document()
            builder.finalize(prefix + ".idx")
        return MMapIndexedDataset(prefix)

    dataset = sentences("with_eod", [256])
    assert len(dataset) == 5 and list(dataset.doc_idx) == [0, 2, 5]
    check_dataset_tokenization(dataset, ByteTokenizer())
    assert capsys.readouterr().out == ""
    check_dataset_tokenization(sentences("without", []), ByteTokenizer())
    assert "none of its first 2 documents ends with" in capsys.readouterr().out
