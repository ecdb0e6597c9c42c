"""zero_to_fp32 (zero/checkpoint/zero_to_fp32.py), the script every DeepSpeed-layout save
copies beside its checkpoint: it runs standalone, reads stages 0-3 (with or without the
optimizer-state files) and says which folder or tag to give when it is given another."""

import math
import os
import subprocess
import sys

import pytest
import torch

from tests.zero import engine_cases as cases
from tests.zero.test_zero_checkpoint import _engine, _load
from zero.checkpoint.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint)

def test_zero_to_fp32_script_runs_standalone(tmp_path):
    engine = _engine(stage=2, precision="fp16", with_frozen=True)
    cases.train_steps(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    masters = cases.fp32_weights(engine)
    out = tmp_path / "out.bin"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(tmp_path / "ckpt" / "zero_to_fp32.py"),
                          str(tmp_path / "ckpt"), str(out)], capture_output=True, text=True,
                         cwd=str(tmp_path), env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    saved = _load(out)
    for name, master in masters.items():
        assert torch.equal(saved[name], master), name
    assert saved["frozen.weight"].dtype == torch.float32
    assert torch.equal(saved["frozen.weight"], engine.module.frozen.weight.float())
    assert torch.equal(saved["position_bias"], engine.module.position_bias.float())
    assert saved["head.weight"].data_ptr() == saved["embed.weight"].data_ptr()
    excluded = convert_zero_checkpoint_to_fp32_state_dict(
        str(tmp_path / "ckpt"), str(tmp_path) + os.sep, exclude_frozen_parameters=True)
    assert excluded.endswith("pytorch_model.bin") and "frozen.weight" not in _load(excluded)


def test_zero_to_fp32_wrong_folders_say_what_to_give(tmp_path, capsys):
    """The tag folder given, `latest` lost or naming nothing, an output folder that is not
    there: one error line each (the output's before any reading), naming what to give."""
    from zero.checkpoint.zero_to_fp32 import main as zero_to_fp32_main
    engine = _engine(stage=2, precision="fp32")
    cases.train_steps(engine, 1)
    save = tmp_path / "ckpt"
    engine.save_checkpoint(str(save), tag="global_step1")
    out = str(tmp_path / "out.bin")
    cases_and_errors = [
        ([str(save / "global_step1"), out], f"{save / 'global_step1'} is one tag of a checkpoint: "
                                            f"give the folder above it, {save} (with -t "
                                            "global_step1)"),
        ([str(save), str(tmp_path / "nodir" / "out.bin")],
         f"the output's folder {tmp_path / 'nodir'} does not exist"),
        ([str(save), out, "-t", "global_step9"], f"checkpoint folder {save / 'global_step9'} "
                                                 "(named by -t) does not exist; saved tags "
                                                 "here: global_step1"),
        ([str(tmp_path), out], f"{tmp_path} holds no ZeRO checkpoint"),
    ]
    for argv, message in cases_and_errors:
        assert zero_to_fp32_main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    (save / "latest").write_text("garbage")
    assert zero_to_fp32_main([str(save), out]) == 1
    assert f"checkpoint folder {save / 'garbage'} (named by {save / 'latest'}) does not exist; " \
           "saved tags here: global_step1" in capsys.readouterr().err
    (save / "latest").unlink()
    assert zero_to_fp32_main([str(save), out]) == 1
    assert f"{save} has no 'latest' file naming the tag to read: give it with -t (saved tags " \
           "here: global_step1)" in capsys.readouterr().err
    assert zero_to_fp32_main([str(save), out, "-t", "global_step1"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out.bin"]  # no temporary file left


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_to_fp32_reads_stage0_checkpoints(tmp_path, precision):
    engine = _engine(stage=0, precision=precision)
    cases.train_steps(engine, 2)
    engine.save_checkpoint(str(tmp_path))
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    for name, master in cases.fp32_weights(engine).items():
        assert torch.equal(consolidated[name], master), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_to_fp32_without_the_optim_states_files_says_the_weights_are_rounded(
        tmp_path, capsys, precision):
    engine = _engine(stage=2, precision=precision)
    cases.train_steps(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    for optim in (tmp_path / "t").glob("*_optim_states.pt"):
        os.remove(optim)  # copied without them: only the model states file
    capsys.readouterr()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    for name, param in engine.module.named_parameters():
        assert torch.equal(consolidated[name], param.detach().float()), name
    note = capsys.readouterr().err
    if precision == "fp32":
        assert note == ""  # the module's own weights are the fp32 masters
    else:
        assert note == (f"note: {tmp_path / 't'} holds no *_optim_states.pt files (saved without "
                        "the optimizer state, or copied without them), so the weights are the "
                        "model states' bfloat16 copies, not the fp32 master weights; copy the "
                        "optim-states files too for those\n")


def test_zero_to_fp32_reads_the_stage3_layout(tmp_path):
    """A stage-3 checkpoint built by hand as DeepSpeed lays it out (2 ranks)."""
    weights = {"a": torch.arange(5.0), "b": torch.arange(6.0).view(2, 3) + 10}
    world, flats = 2, [[], []]
    for tensor in weights.values():
        per_rank = math.ceil(tensor.numel() / world)
        padded = torch.cat([tensor.reshape(-1), torch.zeros(per_rank * world - tensor.numel())])
        for rank in range(world):
            flats[rank].append(padded[rank * per_rank:(rank + 1) * per_rank])
    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir()
    (tmp_path / "latest").write_text("global_step1")
    shapes = [{"a": torch.Size([5]), "b": torch.Size([2, 3])}]
    for rank in range(world):
        torch.save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": world,
                                             "fp32_flat_groups": [torch.cat(flats[rank])]}},
                   tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({"module": {}, "param_shapes": shapes, "buffer_names": [],
                    "shared_params": {}, "frozen_param_shapes": None},
                   tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    result = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert torch.equal(result["a"], weights["a"]) and torch.equal(result["b"], weights["b"])
