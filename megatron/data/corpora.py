"""Named loose-JSON corpora (`--train-data webtext`) and their one-time tokenization.

A named corpus is a loose JSON file (one {"text": ...} object per line) under the data root:
`<repo>/data` by default, or $MEGATRON_DATA_DIR.  The first run tokenizes it into
`<dir>/<stem>_text_document.bin/.idx` next to the JSON (rank 0 builds, the other ranks wait);
later runs reuse those files unless the JSON or the tokenizer changed (the tokenization record
beside them says which source and tokenizer made them).
"""

import os
import time

from megatron.data.indexed_dataset import dataset_exists
from megatron.data.preprocessing import (ConstantFactory, format_summary, output_prefix_for,
                                         tokenize_loose_json)
from megatron.data.rank_zero import build_on_rank_zero, log_rank_zero
from megatron.data.tokenization_record import read_record, tokenization_record
from megatron.errors import DataError

NAMED_CORPORA = {"webtext": os.path.join("webtext", "data.json")}

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def data_root():
    return os.environ.get("MEGATRON_DATA_DIR") or os.path.join(_REPO_ROOT, "data")


def resolve_corpus(name_or_path):
    """Path of the loose JSON for a corpus name (see NAMED_CORPORA) or a path to a .json file."""
    if name_or_path in NAMED_CORPORA:
        path = os.path.join(data_root(), NAMED_CORPORA[name_or_path])
        if not os.path.isfile(path):
            raise DataError(f"corpus {name_or_path!r} expects loose JSON (one {{\"text\": ...}} "
                            f"object per line) at {path}, which does not exist. Put it there "
                            f"(see data/README.md) or set MEGATRON_DATA_DIR to its data root")
        return path
    if os.path.isfile(name_or_path):
        return name_or_path
    if dataset_exists(name_or_path):
        raise DataError(f"--train-data {name_or_path!r} is a tokenized dataset (.bin/.idx); "
                        f"train on it with --data-path {name_or_path} (--train-data takes "
                        "loose JSON)")
    known = ", ".join(f"{name} -> {os.path.join(data_root(), rel)}"
                      for name, rel in sorted(NAMED_CORPORA.items()))
    raise DataError(f"--train-data {name_or_path!r} is neither a known corpus name nor an "
                    f"existing file. Known corpora: {known}")


def prepare_loose_json_corpus(json_path, tokenizer, json_key="text", workers=1, group=None):
    """Tokenize `json_path` (eod appended) into `<dir>/<stem>_<key>_document` unless an up-to-date
    tokenization by the same tokenizer exists; return that data prefix.

    With torch.distributed initialized, rank 0 of `group` builds while the others wait.
    workers > 1 sends the tokenizer to spawned processes, so it must pickle.
    """
    if not os.path.isfile(json_path):
        raise DataError(f"loose JSON corpus {json_path} does not exist")
    stem = os.path.splitext(os.path.basename(json_path))[0]
    output_prefix = os.path.join(os.path.dirname(os.path.abspath(json_path)), stem)
    prefix = output_prefix_for(output_prefix, json_key)
    wanted = tokenization_record(json_path, json_key, True, tokenizer)

    def build_if_needed():
        if dataset_exists(prefix) and read_record(prefix) == wanted:
            return
        log_rank_zero(f" > tokenizing {json_path} into {prefix}.bin/.idx")
        start = time.perf_counter()
        outputs, stats = tokenize_loose_json(json_path, output_prefix, ConstantFactory(tokenizer),
                                             json_keys=(json_key,), append_eod=True,
                                             workers=workers, log_interval=10000)
        log_rank_zero(format_summary(outputs, stats, time.perf_counter() - start))

    build_on_rank_zero(build_if_needed, group, what=f"the tokenized corpus {prefix}")
    if not dataset_exists(prefix):
        raise DataError(f"{prefix}.bin/.idx missing after rank 0 built them; is "
                        f"{os.path.dirname(prefix)} on a filesystem shared by all ranks?")
    return prefix


def corpus_data_prefix(name_or_path, tokenizer, json_key="text", workers=1, group=None):
    """`--train-data NAME|PATH` -> a data prefix for build_train_valid_test_datasets."""
    return prepare_loose_json_corpus(resolve_corpus(name_or_path), tokenizer, json_key,
                                     workers=workers, group=group)
