import io
import pickle

import pytest
import sentencepiece

from megatron.errors import TokenizerError
from megatron.tokenizer import SentencePieceTokenizer, build_tokenizer
from megatron.tokenizer.sentencepiece_tokenizer import train_sentencepiece

from .conftest import UNICODE_SNIPPETS


def sentences_of(texts):
    return [line for text in texts for line in text.split("\n") if line]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, training_texts):
    path = str(tmp_path_factory.mktemp("sp") / "tokenizer.model")
    return train_sentencepiece(sentences_of(training_texts), vocab_size=600, model_path=path)


def test_train_load_and_eod(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert tok.name == "SentencePieceTokenizer" and tok.vocab_size == 600 == len(tok.vocab)
    assert tok.inv_vocab[tok.eod] == "<|endoftext|>"
    assert tok.vocab["<|endoftext|>"] == tok.eod
    # A user-defined symbol: text spelling it becomes the single eod id.
    assert tok.eod in tok.tokenize("end<|endoftext|>start")


@pytest.mark.parametrize("text", UNICODE_SNIPPETS[:4] + ["  two  spaces and\ttab", "🦄 unseen"])
def test_round_trip_is_lossless(sp_model, text):
    tok = SentencePieceTokenizer(sp_model)
    ids = tok.tokenize(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text


def _train_plain_model(path, training_texts, **options):
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences_of(training_texts)), model_writer=model,
        vocab_size=500, model_type="bpe", byte_fallback=True, minloglevel=2, **options,
    )
    path.write_bytes(model.getvalue())
    return str(path)


def test_eod_falls_back_to_eos(tmp_path, training_texts):
    tok = SentencePieceTokenizer(_train_plain_model(tmp_path / "plain.model", training_texts))
    assert tok.eod == 2 and tok.inv_vocab[2] == "</s>"


def test_no_eod_is_an_error(tmp_path, training_texts):
    path = _train_plain_model(tmp_path / "noeos.model", training_texts, eos_id=-1)
    with pytest.raises(TokenizerError, match="neither a '<\\|endoftext\\|>' piece nor an eos id"):
        SentencePieceTokenizer(path)


def test_pickle(sp_model):
    tok = SentencePieceTokenizer(sp_model)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(UNICODE_SNIPPETS[0]) == tok.tokenize(UNICODE_SNIPPETS[0]) and clone.eod == tok.eod


def test_bad_ids_and_bad_files(sp_model, tmp_path):
    tok = SentencePieceTokenizer(sp_model)
    with pytest.raises(TokenizerError, match="id 600"):
        tok.detokenize([5, 600])
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"this is not a protobuf")
    with pytest.raises(TokenizerError, match="corrupt.model.*not a sentencepiece model.*train_tokenizer.py"):
        SentencePieceTokenizer(str(corrupt))
    with pytest.raises(TokenizerError, match="missing.model.*does not exist.*train_tokenizer.py"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))


def test_vocab_too_large_for_corpus(tmp_path):
    with pytest.raises(TokenizerError, match="Vocabulary size too high.*--vocab-size"):
        train_sentencepiece(["tiny corpus"] * 3, vocab_size=5000, model_path=str(tmp_path / "x.model"))
    assert not list(tmp_path.iterdir())  # nothing half-written
