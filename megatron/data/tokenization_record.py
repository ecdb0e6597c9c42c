"""What a `.bin/.idx` dataset was tokenized from and with, recorded beside it and checked.

Every tokenization (tools/preprocess_data.py, a `--train-data` corpus) writes
`<prefix>.source.json`: the source file, its JSON key, whether an end-of-document token ends
each document, and the tokenizer's identity. Training reads it back: a dataset tokenized by
another tokenizer is one clear error even when its ids happen to fit this vocabulary, and a
dataset without document boundaries is said once. Datasets made elsewhere (no record, or one
written for other `.bin/.idx` files: a note says so) get the boundary check from their first
documents instead. A record names its files by size and content, so a copy keeps it.
"""

import hashlib
import json
import os

from megatron.data.indexed_dataset import BUILD_HINT, data_file_path, index_file_path
from megatron.errors import DataError, TokenizerError
from megatron.tokenizer.file_utils import atomic_write_bytes

RECORD_FORMAT = 1
# Tokenized to tell tokenizers apart: two vocabularies of one size still split this differently.
_PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. 1234567890 naïve café, "
               "Straße; 東京 — «quotes» & <tags>\n\ttabs  spaces")
# what decides the ids a text becomes; the class name only names it in messages
_TOKENIZER_FIELDS = ("vocab_size", "eod", "probe_sha1")
_DOCUMENTS_SAMPLED = 1000


def record_path(prefix):
    return prefix + ".source.json"


def tokenizer_identity(tokenizer):
    """The tokenizer's class, vocab size, eod and how it splits a probe text (None when it
    cannot tokenize the probe, e.g. a byte-level vocabulary missing some bytes)."""
    try:
        probe = json.dumps([int(t) for t in tokenizer.tokenize(_PROBE_TEXT)])
        probe_sha1 = hashlib.sha1(probe.encode()).hexdigest()
    except TokenizerError:
        probe_sha1 = None
    return {"tokenizer": type(tokenizer).__name__, "vocab_size": int(tokenizer.vocab_size),
            "eod": int(tokenizer.eod), "probe_sha1": probe_sha1}


def tokenization_record(json_path, json_key, append_eod, tokenizer):
    """The record of tokenizing key `json_key` of loose JSON `json_path` with `tokenizer`, as
    of the source file's present size and modification time."""
    stat = os.stat(json_path)
    return {"format": RECORD_FORMAT, "source": os.path.abspath(json_path),
            "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
            "json_key": json_key, "append_eod": bool(append_eod),
            **tokenizer_identity(tokenizer)}


def read_record(prefix):
    """The record beside `prefix` as a dict, or None: absent, unreadable, not a record, or
    stale (`stale_record`)."""
    record = _stamped_record(prefix)
    if record is None or not _same_files(record.pop(_FILES, None), prefix):
        return None
    return record


def stale_record(prefix):
    """Whether the record beside `prefix` was written for other `.bin/.idx` files than these
    (rewritten by a tool that writes no record, or other files copied over them). A copy of
    the same files is not stale: the record names their sizes and contents, not their
    modification times."""
    record = _stamped_record(prefix)
    return record is not None and not _same_files(record.get(_FILES), prefix)


def _stamped_record(prefix):
    try:
        with open(record_path(prefix)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(prefix, record):
    """Write `record` for the `.bin/.idx` of `prefix` as they are now (so that read_record
    tells when they change)."""
    stamped = {**record, _FILES: _files_stamp(prefix)}
    atomic_write_bytes(record_path(prefix),
                       json.dumps(stamped, indent=1, sort_keys=True).encode("utf-8"))


_FILES = "dataset_files"
_STAMPED_BYTES = 1 << 16  # from each end of a file


def _files_stamp(prefix):
    """Each file's size and a hash of its first and last 64 KiB: what a copy keeps and a
    rebuild changes, read in a moment however large the dataset."""
    stamp = {}
    for path in (data_file_path(prefix), index_file_path(prefix)):
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                digest = hashlib.sha1(f.read(_STAMPED_BYTES))
                f.seek(max(0, size - _STAMPED_BYTES))
                digest.update(f.read(_STAMPED_BYTES))
        except OSError:
            return None
        stamp[os.path.splitext(path)[1][1:]] = [size, digest.hexdigest()]
    return stamp


def _same_files(recorded, prefix):
    """Whether the stamp a record holds is of these files. A record written before stamps
    hashed the files holds [size, mtime_ns]: its sizes are compared (a copy changes the
    time, and a rebuild by another tokenizer the size)."""
    if not isinstance(recorded, dict):
        return False
    if all(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int)
           for entry in recorded.values()):
        try:
            return {ext: entry[0] for ext, entry in recorded.items()} == {
                os.path.splitext(path)[1][1:]: os.path.getsize(path)
                for path in (data_file_path(prefix), index_file_path(prefix))}
        except OSError:
            return False
    return recorded == _files_stamp(prefix)


def remove_record(prefix):
    """Before rebuilding `prefix`: a crash mid-build must not leave an old record vouching."""
    if os.path.exists(record_path(prefix)):
        os.remove(record_path(prefix))


def check_dataset_tokenization(dataset, tokenizer):
    """DataError when MMapIndexedDataset `dataset` was recorded as tokenized by a tokenizer
    other than `tokenizer`; one note when its documents carry no end-of-document token."""
    record = read_record(dataset.prefix)
    if record is None and stale_record(dataset.prefix):
        from megatron.data.rank_zero import log_rank_zero
        log_rank_zero(f" note: {record_path(dataset.prefix)} was written for other .bin/.idx "
                      "files than these (rebuilt by a tool that writes no record?): the "
                      "tokenizer they were made with is not checked; delete it, or rebuild "
                      f"the dataset with tools/preprocess_data.py")
    if record is not None and record.get("format") == RECORD_FORMAT:
        _check_same_tokenizer(dataset.prefix, record, tokenizer_identity(tokenizer))
        if not record.get("append_eod", True):
            _note_no_boundaries(dataset.prefix, "it was tokenized without --append-eod")
    elif len(dataset) and not _any_document_ends_with(dataset, int(tokenizer.eod)):
        sampled = min(len(dataset.doc_idx) - 1, _DOCUMENTS_SAMPLED)
        _note_no_boundaries(dataset.prefix, f"none of its first {sampled} documents ends with "
                                            f"this tokenizer's end-of-document id "
                                            f"{tokenizer.eod} (tokenized without --append-eod, "
                                            f"or by another tokenizer)")


def _check_same_tokenizer(prefix, record, mine):
    differs = [field for field in _TOKENIZER_FIELDS if record.get(field) != mine[field]]
    if not differs:
        return
    theirs = (f"{record.get('tokenizer')} (vocab {record.get('vocab_size')}, "
              f"eod {record.get('eod')})")
    ours = f"{mine['tokenizer']} (vocab {mine['vocab_size']}, eod {mine['eod']})"
    how = "" if differs != ["probe_sha1"] else (
        ", which splits text differently though vocab size and eod agree (other vocab/merge "
        "or model files)")
    raise DataError(f"{data_file_path(prefix)} was tokenized by {theirs}, as "
                    f"{record_path(prefix)} records, but this run's tokenizer is {ours}{how}: its "
                    f"ids would mean other text. Pass the tokenizer files it was built with, or "
                    f"rebuild the dataset with this one ({BUILD_HINT})")


def _any_document_ends_with(dataset, eod):
    """Whether one of the first documents ends with `eod` (a document's last item is the one
    before the next document's first: items are sentences in a sentence-split dataset)."""
    for next_start in dataset.doc_idx[1:_DOCUMENTS_SAMPLED + 1]:
        last_item = int(next_start) - 1
        size = int(dataset.sizes[last_item])
        if size and int(dataset.get(last_item, offset=size - 1, length=1)[0]) == eod:
            return True
    return False


def _note_no_boundaries(prefix, why):
    from megatron.data.rank_zero import log_rank_zero  # imports torch; preprocessing must not
    log_rank_zero(f" note: the documents of {data_file_path(prefix)} carry no end-of-document "
                  f"token ({why}): training samples run from one document into the next with "
                  f"nothing marking the seam, and --reset-position-ids, --reset-attention-mask "
                  f"and --eod-mask-loss find no boundaries")
