import random

import pytest

from megatron.tokenizer.bpe_trainer import count_pretokens, train_byte_level_bpe, write_gpt2_files

WORDS = (
    "the of and to in is was that for on with as by at from his her they have this which be "
    "king queen lord speak night day love death sword crown honour heaven earth thou thee "
    "running jumped quickly tokenizer parallel gradient embedding attention"
).split()

# Text the tests round-trip and compare ids on: scripts, emoji (with modifiers and ZWJ), accents
# (precomposed and combining), whitespace runs, tabs, CR/LF, contractions, digits, controls.
UNICODE_SNIPPETS = [
    "café déjà vu, naïve façade, Ærøskøbing",
    "日本語の文章です。中文测试文本。한국어 텍스트",
    "Привет, мир! Ελληνικά γράμματα. مرحبا بالعالم. שלום",
    "emoji 😀🎉 👍🏽 family 👨‍👩‍👧‍👦 flag 🇳🇴",
    "tabs\tand\t\ttabs, multiple   spaces    here   ",
    "line\nbreaks\n\n\nmany\r\nwindows\r\n",
    "numbers 12345 3.14159 1,000,000 x² ½ Ⅻ ٣٤٥",
    "it's we're they've I'm you'll he'd 'S 'LL",
    "nbsp\u00a0thin\u2009space zero\u200bwidth combining e\u0301 a\u0308",
    "control \x00\x01\x07\x7f chars and ~!@#$%^&*()_+{}|:\"<>?",
    "<|endoftext|> is plain text here",
]


def varied_text(seed, num_sentences):
    rng = random.Random(seed)
    parts = []
    for _ in range(num_sentences):
        words = rng.choices(WORDS, k=rng.randint(3, 12))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(UNICODE_SNIPPETS))
        sentence = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])
        parts.append(sentence + rng.choice([" ", " ", "\n", "\n\n", "  "]))
    return "".join(parts)


@pytest.fixture(scope="session")
def training_texts():
    return [varied_text(seed, 40) for seed in range(6)]  # about 15 KB


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory, training_texts):
    """(vocab.json, merges.txt) of a 600-token byte-level BPE trained on `training_texts`."""
    model = train_byte_level_bpe(count_pretokens(training_texts), vocab_size=600)
    return write_gpt2_files(model, str(tmp_path_factory.mktemp("gpt2_bpe")))
