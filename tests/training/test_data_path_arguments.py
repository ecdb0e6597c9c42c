"""--data-path as users give it: one prefix, a later Megatron-LM's blend (weighted or by
tokens), each split's own (--train-data-path, ...), and the malformed forms, each one error."""

import re

import pytest

from megatron.config import resolve_config
from megatron.errors import ConfigError
from tests.training.test_arguments import BASE, parse


def _without_data_path():
    return [a for i, a in enumerate(BASE) if "--data-path" not in BASE[max(i - 1, 0):i + 1]]


@pytest.mark.parametrize("values, prefixes, weights", [
    (["x"], ("x",), None),
    (["2020"], ("2020",), None),  # one value is a prefix, whatever it reads as
    (["1", "x"], ("x",), (1.0,)),  # one dataset of weight 1 (later Megatron-LM's scripts)
    (["x", "y"], ("x", "y"), None),  # weighted by their tokens, as Megatron-core
    (["3", "x", "1", "y"], ("x", "y"), (0.75, 0.25)),
    (["0.3", "x", "0.7", "y"], ("x", "y"), (0.3, 0.7)),
])
def test_later_megatron_data_paths_are_one_dataset_or_a_blend(values, prefixes, weights):
    from megatron.data.data_path import parse_data_path
    argv = _without_data_path()
    data_path = resolve_config(argv + ["--data-path", *values], world_size=1).data.data_path
    assert data_path == tuple(values)
    blend = parse_data_path(data_path)
    assert blend.prefixes == prefixes
    assert blend.weights == (None if weights is None else pytest.approx(weights))


@pytest.mark.parametrize("values, message", [
    (["0.3", "x", "y"], "a weighted blend alternates weights and prefixes"),
    (["0.3", "x", "0.7"], "a weighted blend alternates weights and prefixes"),
    (["x", "0.5", "y"], "give a weight before every prefix (W1 PREFIX1 W2 PREFIX2 ...) or none"),
    (["0.5", "x", "0", "y"], "every weight must be a positive number"),
    (["nan", "x", "1", "y"], "every weight must be a positive number"),
    (["0.5", "x", "0.5", "x"], "--data-path names x twice"),
])
def test_a_malformed_blend_is_one_error(values, message):
    argv = _without_data_path()
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_config(argv + ["--data-path", *values], world_size=1)


def test_each_split_can_have_its_own_data_path():
    """Later Megatron-LM's --train-data-path / --valid-data-path / --test-data-path: each
    split's own datasets (or blend), instead of --data-path cut by --split."""
    argv = _without_data_path()
    data = resolve_config(argv + ["--train-data-path", "0.4", "a", "0.6", "b",
                                  "--valid-data-path", "v"], world_size=1).data
    assert data.data_path is None
    assert data.split_data_paths == (("0.4", "a", "0.6", "b"), ("v",), None)
    assert parse().data.split_data_paths is None
    for extra, message in (
            (["--data-path", "x", "--train-data-path", "a"], "give exactly one of --data-path"),
            (["--data-path", "x", "--valid-data-path", "v"],
             "--valid-data-path and --test-data-path go with --train-data-path"),
            (["--train-data-path", "a", "--split", "9,1,0"],
             "with --train-data-path each split reads all of its own datasets: drop --split"),
            (["--train-data-path", "a", "--valid-data-path", "0.5", "v", "w"],
             "--valid-data-path 0.5 v w: a weighted blend alternates weights and prefixes")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve_config(argv + extra, world_size=1)


def test_a_data_path_default_given_as_a_string_is_one_prefix():
    """(tools and Megatron-style callers pass defaults={"data_path": "..."})"""
    argv = _without_data_path()
    config = resolve_config(argv, world_size=1, defaults={"data_path": "data/webtext"})
    assert config.data.data_path == ("data/webtext",)


def test_a_split_that_leaves_training_nothing_is_an_error_before_anything_is_built():
    for split in ("0,100,0", "0/1"):
        with pytest.raises(ConfigError, match=f"--split '{split}' gives the train split no "
                                              "share of the documents"):
            parse("--split", split)
