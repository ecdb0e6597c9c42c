import os

import numpy as np
import pytest

import megatron.data.corpora as corpora
from megatron.data.corpora import corpus_data_prefix, prepare_loose_json_corpus, resolve_corpus
from megatron.data.gpt2_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.rank_zero import build_on_rank_zero
from megatron.data.tokenization_record import record_path
from megatron.errors import DataError
from tests.data.fakes import ByteTokenizer, ShiftedByteTokenizer, write_loose_json
from tests.dist_utils import run_distributed

TEXTS = ["first document", "second one", "", "third, a bit longer than the others"]


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_DATA_DIR", str(tmp_path))
    return tmp_path


def test_named_corpus_resolves_under_the_data_root(data_dir):
    with pytest.raises(DataError) as e:
        resolve_corpus("webtext")
    assert str(data_dir / "webtext" / "data.json") in str(e.value)
    assert "MEGATRON_DATA_DIR" in str(e.value)
    os.makedirs(data_dir / "webtext")
    path = write_loose_json(data_dir / "webtext" / "data.json", [{"text": "x"}])
    assert resolve_corpus("webtext") == path


def test_default_data_root_is_the_repo_data_dir(monkeypatch):
    monkeypatch.delenv("MEGATRON_DATA_DIR", raising=False)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert corpora.data_root() == os.path.join(repo, "data")


def test_unknown_corpus_lists_known_names(data_dir):
    with pytest.raises(DataError, match="Known corpora: webtext -> .*webtext/data.json"):
        resolve_corpus("wikipedia")


def test_json_path_is_tokenized_next_to_it_with_eod(data_dir):
    path = write_loose_json(data_dir / "my.json", [{"text": t} for t in TEXTS])
    prefix = corpus_data_prefix(path, ByteTokenizer())
    assert prefix == str(data_dir / "my_text_document")
    docs = [list(d) for d in MMapIndexedDataset(prefix)]
    assert docs == [list(t.encode()) + [256] for t in TEXTS if t]
    assert os.path.exists(record_path(prefix))


def test_rebuilds_only_when_source_or_tokenizer_changes(data_dir, monkeypatch):
    path = write_loose_json(data_dir / "c.json", [{"text": t} for t in TEXTS])
    calls = []
    real = corpora.tokenize_loose_json
    monkeypatch.setattr(corpora, "tokenize_loose_json",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    prefix = prepare_loose_json_corpus(path, ByteTokenizer())
    prepare_loose_json_corpus(path, ByteTokenizer())
    assert len(calls) == 1
    prepare_loose_json_corpus(path, ShiftedByteTokenizer())  # same vocab size, other ids
    assert len(calls) == 2
    assert list(MMapIndexedDataset(prefix)[0][:2]) == [ord("f") + 1, ord("i") + 1]
    write_loose_json(data_dir / "c.json", [{"text": "new content"}])
    prepare_loose_json_corpus(path, ShiftedByteTokenizer())
    assert len(calls) == 3 and len(MMapIndexedDataset(prefix)) == 1
    os.remove(record_path(prefix))
    prepare_loose_json_corpus(path, ShiftedByteTokenizer())
    assert len(calls) == 4


def test_corpus_without_documents(data_dir):
    path = write_loose_json(data_dir / "bad.json", [], raw_lines=[b"not json", b"{}"])
    with pytest.raises(DataError, match="no usable documents"):
        prepare_loose_json_corpus(path, ByteTokenizer())
    assert not os.path.exists(record_path(str(data_dir / "bad_text_document")))


def _distributed_body(rank, world_size, json_path):
    prefix = prepare_loose_json_corpus(json_path, ByteTokenizer())
    train, _, _ = build_train_valid_test_datasets(prefix, "1", [20, 0, 0], 8, seed=3)
    samples = [train[i]["text"].tolist() for i in range(len(train))]

    def fail_on_rank_zero():
        raise DataError("rank zero could not build")

    try:
        build_on_rank_zero(fail_on_rank_zero)
        failure = None
    except DataError as e:
        failure = str(e)
    return prefix, samples, failure


def test_rank_zero_builds_and_others_wait(tmp_path):
    path = write_loose_json(tmp_path / "d.json", [{"text": t * 3} for t in TEXTS])
    (p0, s0, f0), (p1, s1, f1) = run_distributed(_distributed_body, 2, args=(path,))
    assert p0 == p1 and s0 == s1 and len(s0) >= 20
    assert f0 == "rank zero could not build"
    assert f1.startswith("rank 0 failed to build")
    stream_tokens = {t for doc in MMapIndexedDataset(p0) for t in doc}
    assert set(np.ravel(s0)) <= stream_tokens
