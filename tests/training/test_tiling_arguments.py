"""--memory-centric-tiled-linear / --tile-factor: validated with the arithmetic in the error."""

import pytest

import pretrain_gpt2
from megatron.errors import ConfigError
from tests.training.test_arguments import parse


def test_tile_factor_defaults_to_one_and_reaches_the_model_config():
    assert parse("--memory-centric-tiled-linear", "--tile-factor", "64").model.tile_factor == 64
    model = parse("--memory-centric-tiled-linear").model
    assert model.memory_centric_tiled_linear and model.tile_factor == 1
    assert parse("--memory-centric-tiled-linear", "--tile-factor", "4").model.tile_factor == 4
    model = parse().model
    assert not model.memory_centric_tiled_linear and model.tile_factor == 1


@pytest.mark.parametrize("extra, world_size, message", [
    (["--tile-factor", "2"], 1,
     "--tile-factor 2 has no effect without --memory-centric-tiled-linear"),
    (["--memory-centric-tiled-linear", "--tile-factor", "0"], 1,
     "--tile-factor must be a positive integer, got 0"),
    (["--memory-centric-tiled-linear", "--tile-factor", "3"], 1,
     "--tile-factor 3 does not divide the layers: --hidden-size (input of QKV and h->4h, "
     "output of dense and 4h->h) = 64 is not divisible by 3 tiles (64 % 3 = 1)"),
    # Tile factor 64 fits hidden 64 at tensor-parallel size 1, not one TP=2 rank's shard.
    (["--memory-centric-tiled-linear", "--tile-factor", "64", "--model-parallel-size", "2"],
     2, "QKV output 3 * hidden / model-parallel-size = 96 is not divisible by 192 tiles "
        "(96 % 192 = 96)"),
    (["--memory-centric-tiled-linear", "--tile-factor", "4", "--ffn-hidden-size", "200"], 1,
     "h->4h output ffn-hidden / model-parallel-size = 200 is not divisible by 16 tiles "
     "(200 % 16 = 8)"),
])
def test_bad_tile_factor(extra, world_size, message):
    with pytest.raises(ConfigError) as info:
        parse(*extra, world_size=world_size)
    assert message in str(info.value)


def test_bad_tile_factor_is_one_error_line(capsys):
    from tests.training.test_arguments import BASE
    code = pretrain_gpt2.main(BASE + ["--memory-centric-tiled-linear", "--tile-factor", "5"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --tile-factor 5 does not divide the layers")
    assert "Traceback" not in err
