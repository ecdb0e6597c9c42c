"""Property-based fuzzing (Hypothesis) of everything a user hands the trainer: flag values,
DeepSpeed JSON, the bytes of a .bin/.idx pair and preprocessing input.

Each property: the input is either used (and is then valid in the sense that matters) or
rejected with the project's own error type (one clear line); never another exception, never
a hang (a deadline per example), never training on invalid data. Every test is bounded by
its example count (FUZZ_EXAMPLES, default 200 each; ~10 s on 2 cores), and tallies
how its inputs ended, printed with `-s` for docs/reliability.md.
"""

import collections
import functools
import json
import math
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.config import resolve_config
from megatron.config.flags import build_parser
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.json_lines import MalformedLine, parse_record
from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
from megatron.data.token_range import check_token_ids
from megatron.errors import DataError, MegatronError
from tests.reliability.test_cli_fuzz import BASE, CONFIG_SOURCES
from tests.zero.test_config_fuzz import _build_everything as build_everything
from zero import ConfigError as ZeroConfigError
from zero import DeepSpeedConfig
from zero.errors import ZeroError

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=5000, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
OUTCOMES = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module", autouse=True)
def report_outcomes():
    yield
    for name, counts in OUTCOMES.items():
        print(f"\n[fuzz] {name}: {sum(counts.values())} inputs: {dict(counts)}")


# ------------------------------------------------------------------------------ flag values

_PARSER = build_parser()
VALUE_FLAGS = sorted(action.option_strings[0] for action in _PARSER._actions
                     if action.option_strings and action.nargs != 0
                     and action.option_strings[0] != "--help")
NUMERIC_FLAGS = [action.option_strings[0] for action in _PARSER._actions
                 if action.option_strings and action.type in (int, float)]
numbers = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True,
                                                                allow_infinity=True),
                    st.sampled_from([0, -1, 1, 0.5, 1e-12, 1e308]))
flag_values = st.one_of(numbers.map(str), st.text(max_size=12),
                        st.sampled_from(["", "nan", "-inf", "1e999", "0x10", "1_000", " 3"]))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(VALUE_FLAGS), flag_values), min_size=1, max_size=3),
       st.sampled_from([1, 2, 4]))
def test_any_flag_value_is_used_or_one_user_error(pairs, world_size):
    argv = list(BASE)
    for flag, value in pairs:
        argv += [flag, value]
    with tempfile.TemporaryDirectory() as cwd:
        here = os.getcwd()
        os.chdir(cwd)  # whatever a path flag names is relative to an empty folder
        try:
            config = resolve_config(argv, world_size=world_size)
        except (MegatronError, ZeroError) as error:
            assert str(error).strip() and "\n" not in str(error).strip()
            OUTCOMES["flag values"]["user error"] += 1
            return
        except SystemExit as exit_:  # argparse: not a number where one is expected
            assert exit_.code == 2
            OUTCOMES["flag values"]["usage error"] += 1
            return
        finally:
            os.chdir(here)
            assert not os.listdir(cwd), "validation wrote files"
    for key, value in config.as_flat_dict().items():  # an accepted number is a usable one
        if isinstance(value, float):
            assert math.isfinite(value), (key, value, argv)
        elif isinstance(value, int) and not isinstance(value, bool):
            assert abs(value) < 2 ** 31, (key, value, argv)
    OUTCOMES["flag values"]["accepted"] += 1


# ---------------------------------------------------------------------------- DeepSpeed JSON

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2 ** 64, 2 ** 64),
              st.floats(allow_nan=False), st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=8), children, max_size=3)),
    max_leaves=6)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))


@FUZZ
@given(st.sampled_from(CONFIG_SOURCES), st.data())
def test_any_deepspeed_json_is_parsed_or_one_config_error(source, data):
    config = source()
    paths = [p for p in _paths(config) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        node = config
        for key in path[:-1]:
            node = node[key] if isinstance(node, dict) and key in node else None
        if not isinstance(node, dict):
            continue
        if data.draw(st.booleans()):
            node[path[-1]] = data.draw(json_values)
        else:
            node.pop(path[-1], None)
    try:
        # parsed, and what it configures is built: optimizer, lr schedule, loss scaler
        build_everything(DeepSpeedConfig(json.loads(json.dumps(config)), dp_world_size=2))
        OUTCOMES["DeepSpeed JSON"]["accepted"] += 1
    except ZeroConfigError as error:
        assert str(error).strip()
        OUTCOMES["DeepSpeed JSON"]["config error"] += 1


# --------------------------------------------------------------------------- .bin/.idx bytes

VOCAB = 50


@pytest.fixture(scope="module")
def dataset_files(tmp_path_factory):
    """A valid uint16 .bin/.idx of 20 documents, tokens < VOCAB."""
    prefix = str(tmp_path_factory.mktemp("fuzz_data") / "valid")
    rng = np.random.default_rng(0)
    with MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        for _ in range(20):
            builder.add_item(rng.integers(0, VOCAB, rng.integers(0, 30)))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}


byte_edits = st.lists(st.tuples(st.sampled_from([".bin", ".idx"]),
                                st.sampled_from(["overwrite", "truncate", "append"]),
                                st.integers(0, 10 ** 6), st.binary(min_size=1, max_size=8)),
                      min_size=1, max_size=3)


@FUZZ
@given(byte_edits)
def test_any_bin_idx_bytes_are_read_whole_or_one_data_error(dataset_files, tmp_path, edits):
    files = dict(dataset_files)
    for ext, how, position, payload in edits:
        data = files[ext]
        at = position % (len(data) + 1)
        if how == "overwrite":
            files[ext] = data[:at] + payload + data[at + len(payload):]
        elif how == "truncate":
            files[ext] = data[:at]
        else:
            files[ext] = data + payload
    folder = tempfile.mkdtemp(dir=tmp_path)
    prefix = os.path.join(folder, "fuzzed")
    for ext, data in files.items():
        with open(prefix + ext, "wb") as f:
            f.write(data)
    try:
        dataset = MMapIndexedDataset(prefix)
        check_token_ids(dataset, VOCAB, VOCAB)
    except DataError as error:
        assert prefix in str(error) and "\n" not in str(error).strip()
        OUTCOMES[".bin/.idx bytes"]["data error"] += 1
        shutil.rmtree(folder)
        return
    # accepted: every document reads in full and every token is in the vocabulary
    total = 0
    for i in range(len(dataset)):
        tokens = dataset[i]
        assert len(tokens) == dataset.sizes[i] and (len(tokens) == 0 or tokens.max() < VOCAB)
        total += len(tokens)
    assert total * dataset.dtype.itemsize == len(files[".bin"])
    OUTCOMES[".bin/.idx bytes"]["accepted"] += 1
    del dataset  # its memory maps, before the files go
    shutil.rmtree(folder)


# ----------------------------------------------------------------------- preprocessing input

class _ByteTokenizer:
    """Token ids are the UTF-8 bytes (+1), EOD 0: enough to check what reaches the .bin."""
    vocab_size, eod = 257, 0

    def tokenize(self, text):
        return [b + 1 for b in text.encode("utf-8", "surrogatepass")]


good_line = st.text(max_size=20).map(lambda t: json.dumps({"text": t}).encode())
bad_line = st.one_of(
    st.binary(max_size=20),  # anything, often not UTF-8 or not JSON
    json_values.map(lambda v: json.dumps(v).encode()),  # JSON, rarely an object with "text"
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),  # deeply nested
    st.integers(1, 400).map(lambda n: b'{"text": 1' + b"0" * n + b"}"),  # huge numbers
    st.just(b'{"text": "\\ud800"}'))  # a lone surrogate
lines = st.lists(st.one_of(good_line, bad_line), max_size=12)


def _expected_documents(raw_lines):
    documents = []
    for line in raw_lines:
        if not line.strip():
            continue
        try:
            record = parse_record(line, required=("text",))
        except MalformedLine:
            continue
        if isinstance(record.get("text"), str) and record["text"]:
            documents.append(record["text"])
    return documents


@FUZZ
@given(lines)
def test_any_preprocessing_input_is_tokenized_or_skipped_and_counted(tmp_path, raw_lines):
    raw_lines = [line.replace(b"\n", b" ") for line in raw_lines]
    folder = tempfile.mkdtemp(dir=tmp_path)
    source = os.path.join(folder, "input.json")
    with open(source, "wb") as f:
        f.write(b"\n".join(raw_lines) + b"\n")
    expected = _expected_documents(raw_lines)
    with open(os.devnull, "w") as devnull:
        tokenize = functools.partial(tokenize_loose_json, source, os.path.join(folder, "out"),
                                     ConstantFactory(_ByteTokenizer()), append_eod=True,
                                     stream=devnull)
        if not expected:  # nothing usable: an error, and no empty dataset left behind
            with pytest.raises(DataError, match="holds no usable documents"):
                tokenize()
            assert sorted(os.listdir(folder)) == ["input.json"]
            OUTCOMES["preprocessing input"]["no usable line: refused"] += 1
            shutil.rmtree(folder)
            return
        outputs, stats = tokenize()
    dataset = MMapIndexedDataset(outputs["text"])
    # exactly the well-formed lines' texts reach the .bin, in order, each closed by EOD
    texts = [bytes(int(t) - 1 for t in dataset[i][:-1]).decode("utf-8", "surrogatepass")
             for i in range(len(dataset))]
    assert texts == expected
    assert all(dataset[i][-1] == _ByteTokenizer.eod for i in range(len(dataset)))
    assert stats.documents + stats.malformed + stats.empty == \
        sum(1 for line in raw_lines if line.strip())
    assert len(stats.examples) == min(stats.malformed, 5)
    for number, reason in stats.examples:
        assert 1 <= number <= len(raw_lines) and reason
    ended = "some lines skipped" if stats.malformed else "every line used"
    OUTCOMES["preprocessing input"][ended] += 1
    del dataset
    shutil.rmtree(folder)
