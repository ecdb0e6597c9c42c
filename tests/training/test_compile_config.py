"""--compile and the DeepSpeed config's "compile" section resolve to one switch."""

import pytest
import torch

import zero
from tests.training.test_deepspeed import write_config
from tests.training.test_deepspeed_config import parse
from zero.compiler import compile_module
from zero.config.deepspeed_config import DeepSpeedConfig


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


class _RecordsCompile(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []

    def compile(self, *args, gradients_per_layer=False, **kwargs):
        self.calls.append((gradients_per_layer, kwargs))


@pytest.mark.parametrize("stage, offload, per_layer", [
    (0, False, False), (1, False, False), (1, True, True), (2, False, True), (2, True, True)])
def test_the_engine_tells_the_model_when_it_takes_gradients_per_layer(stage, offload,
                                                                       per_layer):
    """ZeRO stage 2 and optimizer offload free or move each layer's gradients during backward,
    so the GPT-2 model keeps a region per layer (GPT2Model.compiles_whole_stack); a module
    whose compile() does not take the argument is compiled with torch.compile's own."""
    zero_section = {"stage": stage,
                    **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization":
                              zero_section, "compile": {"enabled": True,
                                                        "kwargs": {"dynamic": False}}}, 1)
    module = _RecordsCompile()
    assert compile_module(module, config, rank=0)
    assert module.calls == [(per_layer, {"backend": "inductor", "dynamic": False})]
    linear = torch.nn.Linear(2, 2)
    assert compile_module(linear, config, rank=0)
    assert linear._compiled_call_impl is not None
