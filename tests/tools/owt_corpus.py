"""A synthetic webtext corpus where every document has a planted fate.

Pages (two loose JSON files plus a file the merge must ignore) hold English documents,
near-duplicates of one of them, German and French documents, a too-short one, a mojibake one,
an empty one, a repeated URL, invalid JSON, invalid UTF-8 and a record without a URL.
SURVIVORS lists the URLs that must come out of the whole pipeline.
"""

import json
import random

from megatron.tokenizer.bpe_trainer import (count_pretokens, train_byte_level_bpe,
                                            write_gpt2_files)

_WORDS = ("the king queen lord night day love death sword crown honour heaven earth thou thee "
          "shall speak would come go hath doth good sweet fair noble brother sister father "
          "mother friend enemy war peace gold land sea ship storm wind fire water stone").split()
GERMAN = ("Es war einmal ein König, der hatte drei Töchter, und die jüngste war so schön, dass "
          "die Sonne selbst sich wunderte, sooft sie ihr ins Gesicht schien. Nahe bei dem "
          "Schlosse des Königs lag ein großer dunkler Wald, und in dem Walde unter einer alten "
          "Linde war ein Brunnen, und wenn der Tag recht heiß war, so ging das Königskind "
          "hinaus in den Wald und setzte sich an den Rand des kühlen Brunnens.")
FRENCH = ("Il était une fois un roi qui avait trois filles, et la plus jeune était si belle que "
          "le soleil lui-même s'étonnait chaque fois qu'il éclairait son visage. Près du château "
          "du roi se trouvait une grande forêt sombre, et dans cette forêt, sous un vieux "
          "tilleul, il y avait une fontaine où la princesse allait s'asseoir quand il faisait "
          "chaud.")
MIN_TOKENS = 40
SURVIVORS = ["https://site.example/en/0", "https://site.example/en/1",
             "https://site.example/mojibake", "https://site.example/en/3",
             "https://site.example/en/4", "https://site.example/en/5"]


def english(seed, sentences=10):
    rng = random.Random(seed)
    return " ".join(" ".join(rng.choices(_WORDS, k=rng.randint(6, 12))).capitalize() + "."
                    for _ in range(sentences))


def near_copy(text, seed, changes=2):
    """`text` with `changes` words replaced: Jaccard of 5-shingles stays around 0.9."""
    words = text.split(" ")
    rng = random.Random(seed)
    for position in rng.sample(range(len(words)), changes):
        words[position] = "zephyr"
    return " ".join(words)


def _line(text, url=None):
    record = {"text": text} if url is None else {"text": text, "url": url}
    return json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"


def write_pages(directory):
    """The page files under `directory`; returns the expected per-stage numbers."""
    directory.mkdir(parents=True, exist_ok=True)
    base = english(0)
    mojibake = ("At the café we sat. " + english(2)).encode("utf-8").decode("latin-1")
    (directory / "a.json").write_bytes(b"".join([
        _line(base, "https://site.example/en/0"),
        _line(english(1), "https://site.example/en/1"),
        _line(GERMAN, "https://site.example/de"),
        b'{"text": "an unterminated string, "url": \n',                      # invalid JSON
        _line(near_copy(base, 1), "https://site.example/en/0-copy"),
        _line("Thou shalt.", "https://site.example/short"),
        _line(mojibake, "https://site.example/mojibake"),
    ]))
    (directory / "b.jsonl").write_bytes(b"".join([
        b'{"text": "\xff\xfe broken bytes", "url": "https://site.example/bytes"}\n',  # not UTF-8
        _line(english(11), "https://site.example/en/1"),                      # URL seen before
        _line(FRENCH, "https://site.example/fr"),
        _line(english(12)),                                                   # no url
        _line(near_copy(near_copy(base, 1), 2), "https://site.example/en/0-copy2"),
        _line(english(3), "https://site.example/en/3"),
        _line("   \n  ", "https://site.example/empty"),
        _line(english(4), "https://site.example/en/4"),
        _line(english(5), "https://site.example/en/5"),
    ]))
    (directory / "notes.txt").write_text("not a page file; merge_jsons ignores it\n")
    return {"merge_read": 16, "merge_kept": 11,
            "merge_dropped": {"duplicate url": 1, "empty text": 1, "malformed: invalid JSON": 1,
                              "malformed: invalid UTF-8": 1,
                              "malformed: no string under 'url'": 1},
            "cleanup_dropped": {f"fewer than {MIN_TOKENS} tokens": 1, "language de": 1,
                                "language fr": 1},
            "near_duplicates": ["https://site.example/en/0-copy",
                                "https://site.example/en/0-copy2"]}


def write_tokenizer(directory):
    """A 400-token byte-level BPE trained on English-like text: (vocab.json, merges.txt)."""
    texts = [english(seed) for seed in range(40)]
    return write_gpt2_files(train_byte_level_bpe(count_pretokens(texts), vocab_size=400),
                            str(directory))
