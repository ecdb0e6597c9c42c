"""A small real-text corpus, tokenizer and .bin/.idx shared by the trainer tests."""

import json
import random

import pytest

from megatron.tokenizer.bpe_trainer import count_pretokens, train_byte_level_bpe, write_gpt2_files

_WORDS = ("the king queen lord night day love death sword crown honour heaven earth thou thee "
          "shall speak would come go hath doth good sweet fair noble brother sister father "
          "mother friend enemy war peace gold land sea ship storm wind fire water stone").split()


def _document(rng):
    sentences = []
    for _ in range(rng.randint(4, 12)):
        words = rng.choices(_WORDS, k=rng.randint(4, 14))
        sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return " ".join(sentences)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """dict(json, vocab, merges, prefix): 200 documents, a 512-token BPE, and its .bin/.idx."""
    from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
    from megatron.tokenizer import build_tokenizer
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    texts = [_document(rng) for _ in range(200)]
    json_path = root / "data.json"
    with open(json_path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "url": f"https://example.com/{i}"}) + "\n")
    vocab, merges = write_gpt2_files(
        train_byte_level_bpe(count_pretokens(texts), vocab_size=512), str(root / "tok"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    prefix = str(root / "corpus")
    tokenize_loose_json(str(json_path), prefix, ConstantFactory(tokenizer), append_eod=True)
    return {"json": str(json_path), "vocab": vocab, "merges": merges,
            "prefix": prefix + "_text_document", "root": root}
