"""--compile and the DeepSpeed config's "compile" section resolve to one switch."""

import pytest

import zero
from tests.training.test_deepspeed import parse, write_config


def test_compile_flag_and_the_config_section_are_one_switch(tmp_path):
    """--compile turns on the config's "compile" (keeping its other keys); without
    --deepspeed it goes into the stage 0 config the flags build."""
    assert parse("--compile").engine.ds_config.compile.enabled
    assert not parse().engine.ds_config.compile.enabled
    config = write_config(tmp_path, compile={"backend": "aot_eager"})
    section = parse("--deepspeed", "--deepspeed_config", config, "--compile").engine.ds_config\
        .compile
    assert (section.enabled, section.backend) == (True, "aot_eager")
    assert not parse("--deepspeed", "--deepspeed_config", config).engine.ds_config\
        .compile.enabled
    config = write_config(tmp_path, compile="auto")
    assert parse("--deepspeed", "--deepspeed_config", config, "--compile").engine.ds_config\
        .compile.enabled
    config = write_config(tmp_path, compile=True)
    with pytest.raises(zero.ConfigError, match="'compile' must be a JSON object"):
        parse("--deepspeed", "--deepspeed_config", config, "--compile")
