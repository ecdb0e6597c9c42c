"""Entry points: one error line (once per job, not once per rank), Ctrl-C as exit code 130."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.cli import run_cli
from megatron.errors import ConfigError, DataError, Interrupted, TrainingError


def _raise(error):
    def main():
        raise error
    return main


@pytest.mark.parametrize("rank", ["0", "3"])
def test_errors_every_rank_meets_alike_are_printed_by_rank_0_only(monkeypatch, capsys, rank):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets them
    import zero.errors  # the engine's DeepSpeed-config errors are zero's own, marked
    parsed = zero.errors.ConfigError("train_batch_size 3 is not divisible")
    parsed.same_on_every_rank = True
    for error in (ConfigError("bad flag"), DataError("bad file"), parsed):
        assert run_cli(_raise(error)) == 2
        printed = capsys.readouterr().err
        assert printed == (f"error: {error}\n" if rank == "0" else "")


def test_rank_specific_errors_are_printed_by_every_rank(monkeypatch, capsys):
    import zero.errors
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert run_cli(_raise(TrainingError("rank 3: a collective failed"))) == 2
    assert capsys.readouterr().err == "error: rank 3: a collective failed\n"
    # zero's own: an NVMe folder this node lacks
    assert run_cli(_raise(zero.errors.ConfigError("nvme_path /nvme does not exist"))) == 2
    assert capsys.readouterr().err == "error: nvme_path /nvme does not exist\n"


def test_ctrl_c_is_exit_code_130_without_a_traceback(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert run_cli(_raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert run_cli(_raise(Interrupted(" stopped by Ctrl-C after saving"))) == 130
    assert capsys.readouterr().err == " stopped by Ctrl-C after saving\n"
    assert run_cli(_raise(Interrupted(""))) == 130  # other ranks: rank 0 said it
    assert capsys.readouterr().err == ""


def test_ctrl_c_inside_a_write_that_fails_on_its_way_out_is_still_130(monkeypatch, capsys):
    """torch.save interrupted as it writes a file: its zip writer, closing, raises a
    RuntimeError while the KeyboardInterrupt unwinds; that is the interrupt, not a bug. A bug
    is still a traceback."""
    monkeypatch.delenv("RANK", raising=False)

    def interrupted_save():
        try:
            raise KeyboardInterrupt
        finally:  # (what torch's writer does on its way out)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                               "71616128 vs 71616016")
    assert run_cli(interrupted_save) == 130
    assert capsys.readouterr().err == "interrupted (then, on the way out: [enforce fail at " \
                                      "inline_container.cc:672] . unexpected pos 71616128 vs " \
                                      "71616016)\n"
    with pytest.raises(RuntimeError, match="a bug"):
        run_cli(_raise(RuntimeError("a bug")))


def test_a_path_the_user_may_not_write_is_one_error_line(capsys):
    def write():
        raise PermissionError(13, "Permission denied", "/data/ro/corpus.bin.tmp.7")
    assert run_cli(write) == 2
    assert capsys.readouterr().err == (
        "error: Permission denied: /data/ro/corpus.bin.tmp.7: this user cannot write (or read) "
        "there; give a path it can, or fix the folder's permissions\n")


def test_success_is_0():
    assert run_cli(lambda: None) == 0


# Every check of the flags and the DeepSpeed JSON, and --help, comes before anything imports
# torch (seconds on a slow CPU); only a JSON's optimizer, scheduler or enabled compile section
# needs it.
_WITHOUT_TORCH = """
import sys
import pretrain_gpt2
try:
    code = pretrain_gpt2.main(sys.argv[1:])  # a user error: `error: ...`, 2
except SystemExit as done:  # argparse's errors and --help
    code = done.code
print("exit", code, "torch imported:", "torch" in sys.modules)
"""
_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
_RUN = _SHAPE + ["--seq-length", "32", "--batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]


def _check_without_torch(argv, message, code):
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert message in done.stdout + done.stderr
    assert "torch imported: False" in done.stdout, done.stdout + done.stderr
    assert f"exit {code}" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--num-layerz", "2"], "unrecognized arguments: --num-layerz"),
    (_SHAPE, "--seq-length is required"),
    (_RUN + ["--hidden-size", "30"], "--num-attention-heads 4 must divide --hidden-size 30"),
    (_RUN + ["--model-parallel-size", "2"], "world size 1 is not divisible by"),
    (_RUN + ["--model-size", "gpt2-huge"], "--model-size 'gpt2-huge' is not known"),
    (_RUN + ["--data-path", "0.3", "a", "b"],
     "--data-path 0.3 a b: a weighted blend alternates weights and prefixes"),
    (_RUN + ["--data-path", "a", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v",
             "--merge-file", "m", "--split", "-1,50,1"],
     "error: --split '-1,50,1' needs non-negative weights"),
    (_RUN + ["--scaled-masked-softmax-fusion"],
     "error: Megatron-LM flag not taken here (drop it): --scaled-masked-softmax-fusion: "
     "attention is torch's scaled_dot_product_attention"),
])
def test_the_trainers_flags_are_checked_before_torch_is_imported(argv, message):
    _check_without_torch(argv, message, 2)


def test_help_and_a_deepspeed_jsons_mistakes_need_no_torch(tmp_path):
    _check_without_torch(["--help"], "--num-layers", 0)
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                   "zero_optimisation": {"stage": 1}}))
    _check_without_torch(_RUN + ["--deepspeed", "--deepspeed_config", str(ds_json)],
                         "did you mean 'zero_optimization'", 2)


# What generation and the checkpoint tools import, and an inference forward: never
# torch._dynamo (2-3 s on a slow CPU), which only training (torch.optim) and compiling need.
_WITHOUT_DYNAMO = """
import sys
import megatron.convert.loaders, megatron.convert.savers, megatron.inference.text_generation
import torch
from megatron.model import GPT2Model, GPTConfig
model = GPT2Model(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64,
                            max_position_embeddings=8, hidden_dropout=0.1, attention_dropout=0.1))
with torch.no_grad():
    model.eval()(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], None)
print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
"""


def test_generation_and_the_checkpoint_tools_never_import_torch_dynamo():
    done = subprocess.run([sys.executable, "-c", _WITHOUT_DYNAMO], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert "torch._dynamo imported: False" in done.stdout, done.stdout + done.stderr
