"""A `sentencepiece` model file (`--tokenizer-model`) behind Megatron's tokenizer interface."""

import io
import os

import sentencepiece

from megatron.errors import TokenizerError
from megatron.tokenizer.file_utils import atomic_write_bytes
from megatron.tokenizer.gpt2_bpe import EOD_TOKEN

HOW_TO_GET_MODEL = (
    "Build one from your corpus with `python tools/train_tokenizer.py --input corpus.json "
    "--tokenizer-type SentencePieceTokenizer --output-dir DIR` and pass "
    "--tokenizer-model DIR/tokenizer.model."
)


class SentencePieceTokenizer:
    """eod is `<|endoftext|>` when the model has that piece, else the model's eos id."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file):
        if not os.path.isfile(model_file):
            raise TokenizerError(f"tokenizer model '{model_file}' (--tokenizer-model) does not "
                                 f"exist. {HOW_TO_GET_MODEL}")
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.load(model_file)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(
                f"tokenizer model '{model_file}' (--tokenizer-model) is not a sentencepiece model "
                f"({e}). {HOW_TO_GET_MODEL}"
            ) from None
        self.vocab = {self._processor.id_to_piece(i): i
                      for i in range(self._processor.get_piece_size())}
        self.inv_vocab = {i: piece for piece, i in self.vocab.items()}
        self.eod = self._find_eod(model_file)

    def _find_eod(self, model_file):
        eod_id = self._processor.piece_to_id(EOD_TOKEN)  # the unk id when the piece is absent
        if not self._processor.is_unknown(eod_id) and \
                self._processor.id_to_piece(eod_id) == EOD_TOKEN:
            return eod_id
        if self._processor.eos_id() >= 0:
            return self._processor.eos_id()
        raise TokenizerError(
            f"tokenizer model '{model_file}' has neither a '{EOD_TOKEN}' piece nor an eos id, so "
            f"there is no end-of-document token. Retrain it with "
            f"`--user_defined_symbols={EOD_TOKEN}` (tools/train_tokenizer.py does this) or with "
            "eos enabled."
        )

    @property
    def vocab_size(self):
        return self._processor.get_piece_size()

    def tokenize(self, text):
        return self._processor.encode(text, out_type=int)

    def detokenize(self, ids):
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(
                f"cannot detokenize id {bad[0]}: the tokenizer has ids 0..{self.vocab_size - 1} "
                f"(ids in the padded part of the model's vocab have no text)"
            )
        return self._processor.decode(ids)


def train_sentencepiece(sentences, vocab_size, model_path):
    """Train a BPE sentencepiece model from an iterable of sentences; write it atomically.

    Identity normalisation and kept whitespace make detokenize(tokenize(text)) == text; bytes
    the vocab has no piece for fall back to byte pieces instead of <unk>.
    """
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            user_defined_symbols=[EOD_TOKEN],
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=False,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise TokenizerError(f"sentencepiece training failed: {e} (adjust --vocab-size)") from None
    atomic_write_bytes(model_path, model.getvalue())
    return model_path
