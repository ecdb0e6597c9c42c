"""The scripts check the environment variables they read before anything runs: a mistyped value
stops them at once with the variable named, before setup, data preparation or arithmetic on it
(scripts/check_env.sh)."""

import subprocess

import pytest

from tests.parallel.launching import REPO, clean_environment

# (script, variables, the one line it must stop with)
BAD_VARIABLES = [
    ("pretrain_gpt2.sh", dict(TRAIN_ITERS="abc"), "TRAIN_ITERS must be a whole number >= 1 (got 'abc')"),
    ("pretrain_gpt2.sh", dict(SEQ_LEN="1.5"), "SEQ_LEN must be a whole number >= 1 (got '1.5')"),
    ("pretrain_gpt2.sh", dict(NLAYERS="-2"), "NLAYERS must be a whole number >= 1 (got '-2')"),
    ("pretrain_gpt2.sh", dict(WARMUP_ITERS="ten"),
     "WARMUP_ITERS must be a whole number >= 0 (got 'ten')"),
    ("pretrain_gpt2.sh", dict(LR="fast"),
     "LR must be a non-negative number such as 3, 0.5 or 1e-3 (got 'fast')"),
    ("pretrain_gpt2.sh", dict(PRECISION="bf61"),
     "PRECISION must be one of: bf16 fp16 fp32 (got 'bf61')"),
    ("pretrain_gpt2_distributed.sh", dict(GPUS_PER_NODE="0"),
     "GPUS_PER_NODE must be a whole number >= 1 (got '0')"),
    ("pretrain_gpt2_distributed.sh", dict(MP_SIZE="0"), "MP_SIZE must be a whole number >= 1 (got '0')"),
    ("pretrain_gpt2_distributed.sh", dict(NNODES="2", NODE_RANK="2"),
     "NODE_RANK=2 must be below NNODES=2 (counted from 0)"),
    ("pretrain_gpt2_distributed.sh", dict(NODE_RANK="1"),
     "NODE_RANK=1 must be below NNODES=1 (counted from 0)"),
    ("pretrain_gpt2_model_parallel.sh", dict(PP_SIZE="two"),
     "PP_SIZE must be a whole number >= 1 (got 'two')"),
    ("pretrain_gpt2_model_parallel.sh", dict(PP_SIZE="4", NLAYERS="3"),
     "PP_SIZE=4 is more pipeline stages than NLAYERS=3: every stage needs at least one layer"),
    ("pretrain_gpt2_distributed.sh", dict(PP_SIZE="2", VP_LAYERS="2", NLAYERS="6"),
     "NLAYERS=6 is not divisible by VP_LAYERS=2 x PP_SIZE=2 (each stage's layers are split "
     "into model chunks of VP_LAYERS layers)"),
    ("pretrain_gpt2_distributed.sh", dict(PP_SIZE="1", VP_LAYERS="1"),
     "VP_LAYERS=1 needs PP_SIZE > 1 (it splits each pipeline stage's layers into interleaved "
     "model chunks)"),
    ("pretrain_gpt2_distributed.sh", dict(MASTER_PORT="70000"),
     "MASTER_PORT must be a port from 1 to 65535 (got '70000')"),
    ("pretrain_gpt2_distributed.sh", dict(NNODES="2", MASTER_ADDR="bad host"),
     "MASTER_ADDR must be a host name or address (got 'bad host')"),
    ("pretrain_gpt2_distributed.sh", dict(RDZV_ENDPOINT="localhost:abc"),
     "RDZV_ENDPOINT must be host:port, the port from 1 to 65535 (got 'localhost:abc')"),
    ("pretrain_gpt2_distributed.sh", dict(DISTRIBUTED_TIMEOUT_MINUTES="abc"),
     "DISTRIBUTED_TIMEOUT_MINUTES must be a non-negative number such as 3, 0.5 or 1e-3 (got "
     "'abc')"),
    ("ds_pretrain_gpt2.sh", dict(ZERO_STAGE="4"), "ZERO_STAGE must be one of: 0 1 2 3 (got '4')"),
    ("ds_pretrain_gpt2.sh", dict(REMOTE_DEVICE="gpu"),
     "REMOTE_DEVICE must be one of: none cpu nvme (got 'gpu')"),
    ("ds_pretrain_gpt2.sh", dict(MICRO_BATCH="8x"), "MICRO_BATCH must be a whole number >= 1 (got '8x')"),
    ("ds_zero2_pretrain_gpt2_model_parallel.sh", dict(ZERO_STAGE="two"),
     "ZERO_STAGE must be one of: 0 1 2 3 (got 'two')"),
    ("ds_zero2_pretrain_gpt2_model_parallel.sh", dict(MP_SIZE="-1"),
     "MP_SIZE must be a whole number >= 1 (got '-1')"),
    ("ds_zero_offload_pretrain_gpt2.sh", dict(OFFLOAD="cpu"), "OFFLOAD must be one of: nvme (got 'cpu')"),
    ("generate_text.sh", dict(TEMPERATURE="hot"),
     "TEMPERATURE must be a non-negative number such as 3, 0.5 or 1e-3 (got 'hot')"),
    ("evaluate_zeroshot_gpt2.sh", dict(OVERLAP="0"), "OVERLAP must be a whole number >= 1 (got '0')"),
    ("prepare_webtext.sh", dict(DEMO_DOCS="all"), "DEMO_DOCS must be a whole number >= 0 (got 'all')"),
    ("prepare_default_data.sh", dict(VOCAB_SIZE="8k"), "VOCAB_SIZE must be a whole number >= 1 (got '8k')"),
    ("setup.sh", dict(EXTRAS="test,tests"), "EXTRAS: unknown extra 'tests'; the extras are test, "
     "convert and webtext (comma-separated, e.g. EXTRAS=test,convert)"),
    ("setup.sh", dict(PYTHON="python9"), "PYTHON=python9 is not a Python >= 3.9 interpreter on "
     "PATH; the venv needs one (e.g. PYTHON=python3.11 bash scripts/setup.sh)"),
]


@pytest.mark.parametrize("script,variables,message", BAD_VARIABLES,
                         ids=[f"{s}-{'-'.join(v)}" for s, v, _ in BAD_VARIABLES])
def test_a_bad_variable_stops_the_script_before_setup(tmp_path, script, variables, message):
    # A setup that fails at once (no interpreter, an empty venv path): had the check not
    # stopped the script, its output would end in setup's error instead.
    env = clean_environment(**{"PYTHON": "false", "VENV": str(tmp_path / "venv"),
                               "DATA_DIR": str(tmp_path / "data"), **variables})
    done = subprocess.run(["bash", f"scripts/{script}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "venv").exists()


def _checked(snippet, **variables):
    env = clean_environment(**variables)
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source scripts/check_env.sh; "
                           f"{snippet}"], cwd=REPO, env=env, capture_output=True, text=True)


def test_good_and_unset_values_pass_and_leading_zeros_are_dropped():
    done = _checked("require_whole 1 A B UNSET; require_whole 0 Z; require_number C D E; "
                    "require_one_of P bf16 fp32; require_below Z A; echo $A $B $Z",
                    A="08", B="300", Z="0", C="1e-3", D=".5", E="3.", P="fp32", UNSET="")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["8", "300", "0"]


def test_trainer_flags_set_the_variables_the_script_builds_them_from():
    """`bash scripts/pretrain_gpt2.sh --train-iters 20` is TRAIN_ITERS=20: the warmup and the
    save interval the script derives from it follow (before, its --warmup-iters 30 was more
    than the 20 iterations and the trainer refused the run)."""
    done = _checked("take_trainer_flags --train-iters 20 --micro-batch-size=4 --lr 5e-4 "
                    "--train-iters 30 --fp16; echo $TRAIN_ITERS $MICRO_BATCH $LR "
                    "${_FLAG_OF[TRAIN_ITERS]} ${WARMUP_FRACTION_GIVEN:-none}", LR="5e-4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["30", "4", "5e-4", "--train-iters", "none"]
    done = _checked("take_trainer_flags --warmup 0.1; echo $WARMUP_FRACTION_GIVEN")
    assert done.stdout.split() == ["1"]


def test_under_a_batch_size_ramp_the_scripts_give_the_lengths_in_samples():
    """--rampup-batch-size among a launch script's arguments: the trainer takes lengths in
    samples then, so TRAIN_ITERS and WARMUP_ITERS become samples (x GLOBAL_BATCH)."""
    lengths = "run_length_args; echo ${LENGTH_ARGS[@]}"
    done = _checked(f"take_trainer_flags --fp16; {lengths}", TRAIN_ITERS="10", WARMUP_ITERS="2",
                    GLOBAL_BATCH="32")
    assert done.stdout.split() == ["--train-iters", "10", "--warmup-iters", "2"], done.stderr
    done = _checked(f"take_trainer_flags --rampup-batch-size 8 8 100; {lengths}",
                    TRAIN_ITERS="10", WARMUP_ITERS="2", GLOBAL_BATCH="32")
    assert done.stdout.split() == ["--train-samples", "320", "--lr-warmup-samples", "64"], \
        done.stderr
    done = _checked(f"take_trainer_flags --rampup-batch-size 8 8 100 --warmup 0.1; {lengths}",
                    TRAIN_ITERS="10", GLOBAL_BATCH="32")
    assert done.stdout.split() == ["--train-samples", "320"], done.stderr
    done = _checked("take_trainer_flags --rampup-batch-size 8 8 100 --train-iters 5")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "--train-iters with --rampup-batch-size: the trainer takes lengths in samples then; give "
        "TRAIN_ITERS=N (global batches of GLOBAL_BATCH) and the script passes N x GLOBAL_BATCH "
        "samples")


@pytest.mark.parametrize("script, variables, extra, message", [
    ("pretrain_gpt2.sh", dict(TRAIN_ITERS="10"), ["--train-iters", "4"],
     "TRAIN_ITERS=10 and --train-iters 4 both set TRAIN_ITERS: give one of them"),
    ("ds_pretrain_gpt2.sh", {}, ["--batch-size", "8x"],
     "--batch-size must be a whole number >= 1 (got '8x')"),
    ("pretrain_gpt2_distributed.sh", {}, ["--lr", "fast"],
     "--lr must be a non-negative number such as 3, 0.5 or 1e-3 (got 'fast')"),
    ("pretrain_gpt2_distributed.sh", dict(WARMUP_ITERS="3"), ["--warmup", "0.1"],
     "WARMUP_ITERS=3 and --warmup (a fraction, or --lr-warmup-samples/-tokens) both set the "
     "warmup: give one of them"),
    ("pretrain_gpt2.sh", {}, ["--lr-warmup-iters=2", "--lr-warmup-tokens", "4096"],
     "--lr-warmup-iters 2 and --warmup (a fraction, or --lr-warmup-samples/-tokens) both set "
     "the warmup: give one of them"),
    ("ds_pretrain_gpt2.sh", {}, ["--train-samples=64"],
     "--train-samples: this script sets the run's length in iterations; give TRAIN_ITERS=N "
     "(samples / global batch) instead"),
], ids=["env-and-flag", "wrapper-bad-value", "bad-lr", "env-and-fraction", "two-warmups",
        "samples"])
def test_a_trainer_flag_against_its_variable_stops_the_script_before_setup(
        tmp_path, script, variables, extra, message):
    env = clean_environment(PYTHON="false", VENV=str(tmp_path / "venv"), **variables)
    done = subprocess.run(["bash", f"scripts/{script}", *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "venv").exists()


def test_a_number_too_long_for_bash_arithmetic_is_refused():
    done = _checked("require_whole 1 N", N="1" * 19)
    assert done.returncode == 2
    assert done.stderr.startswith("N must be a whole number >= 1")


@pytest.mark.parametrize("script, extra, message", [
    ("pretrain_gpt2.sh", ["--fp166"],
     "error: unrecognized arguments: --fp166 (did you mean --fp16?) (pretrain_gpt2.py --help "
     "lists the flags)"),
    ("pretrain_gpt2_distributed.sh", ["--clip-grad", "fast"],
     "error: argument --clip-grad: invalid float value: 'fast' (pretrain_gpt2.py --help lists "
     "the flags)"),
    ("ds_pretrain_gpt2.sh", ["--split", "-1,50,1"],
     "error: --split '-1,50,1' needs non-negative weights"),
], ids=["typo", "bad-value", "bad-split"])
def test_a_bad_trainer_argument_stops_the_script_before_the_data_is_prepared(
        tmp_path, script, extra, message):
    """The launch scripts' extra arguments are pretrain_gpt2.py's: checked once setup has made
    the venv, before minutes of corpus download, tokenizer training and preprocessing."""
    env = clean_environment(DATA_DIR=str(tmp_path / "data"))
    done = subprocess.run(["bash", f"scripts/{script}", *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr
    assert not (tmp_path / "data").exists()  # nothing prepared


@pytest.mark.parametrize("script, extra, message", [
    ("pretrain_gpt2_model_parallel.sh", ["--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size is set by this script from PP_SIZE (it lays out the "
     "processes with it): set PP_SIZE=N instead of passing the flag"),
    ("ds_zero2_pretrain_gpt2_model_parallel.sh", ["--lr", "1e-3", "--model-parallel-size=2"],
     "--model-parallel-size is set by this script from MP_SIZE (it lays out the processes with "
     "it): set MP_SIZE=N instead of passing the flag"),
    ("pretrain_gpt2_distributed.sh", ["--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage is set by this script from VP_LAYERS (it lays "
     "out the processes with it): set VP_LAYERS=N instead of passing the flag"),
    ("pretrain_gpt2_model_parallel.sh", ["--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size is set by this script from MP_SIZE (it lays out the "
     "processes with it): set MP_SIZE=N instead of passing the flag"),
], ids=["pp", "tp-equals", "vp", "tp-later-name"])
def test_a_layout_flag_the_script_sets_from_a_variable_is_refused(tmp_path, script, extra,
                                                                   message):
    """The script sizes data parallelism, the global batch and the checkpoint folder from
    MP_SIZE/PP_SIZE/VP_LAYERS: the same flag passed after them would change the layout
    behind its back."""
    env = clean_environment(PYTHON="false", VENV=str(tmp_path / "venv"))
    done = subprocess.run(["bash", f"scripts/{script}", *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [message]


def test_another_launchers_name_for_a_variable_gets_a_note(tmp_path):
    env = clean_environment(PYTHON="false", VENV=str(tmp_path / "venv"), PP="2", TP_SIZE="2",
                            DATA_DIR=str(tmp_path / "data"))
    done = subprocess.run(["bash", "scripts/pretrain_gpt2_model_parallel.sh"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert " note: TP_SIZE=2 is not read by this script; MP_SIZE is (e.g. MP_SIZE=2)" in lines
    assert " note: PP=2 is not read by this script; PP_SIZE is (e.g. PP_SIZE=2)" in lines


def test_help_answers_before_the_data_is_prepared(tmp_path):
    env = clean_environment(DATA_DIR=str(tmp_path / "data"), TRAINER_ARGS="not an array")
    done = subprocess.run(["bash", "scripts/pretrain_gpt2.sh", "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: pretrain_gpt2.py" in done.stdout and "--num-layers" in done.stdout
    assert not (tmp_path / "data").exists()


def _run_from(folder, script, tmp_path, *args, **variables):
    """The script run from `folder` (not the repository), with a setup that fails at once."""
    env = clean_environment(**{"PYTHON": "false", "VENV": str(tmp_path / "venv"), **variables})
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=60)


def test_relative_paths_in_the_variables_are_read_from_where_the_script_runs(tmp_path):
    """The scripts work in the repository's root; DATA_DIR=data run in /home/me meant
    /home/me/data (it built a second corpus in the repository)."""
    done = _run_from(tmp_path, "generate_text.sh", tmp_path, CHECKPOINT_DIR="mine")
    assert done.stderr.strip() == f"error: no checkpoint at {tmp_path}/mine; train one with " \
                                  "bash scripts/pretrain_gpt2.sh"
    (tmp_path / "corpus" / "webtext").mkdir(parents=True)
    (tmp_path / "corpus" / "webtext" / "data.json").write_text("{}")
    done = _run_from(tmp_path, "pretrain_gpt2.sh", tmp_path, DATA_DIR="corpus/webtext")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"DATA_DIR={tmp_path}/corpus/webtext holds a corpus itself (data.json or "
        "*_text_document.idx); give the folder above it, the one that holds webtext/ and "
        f"tokenizer/ (DATA_DIR={tmp_path}/corpus)")
    done = _run_from(tmp_path, "pretrain_gpt2.sh", tmp_path,
                     DATA_DIR="corpus/webtext/data.json")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"DATA_DIR={tmp_path}/corpus/webtext/data.json is a file; give the folder that holds "
        "(or will hold) webtext/ and tokenizer/")
    assert not (tmp_path / "venv").exists()


def test_another_scripts_variables_get_a_note(tmp_path):
    done = _run_from(tmp_path, "pretrain_gpt2.sh", tmp_path, DATA_DIR=str(tmp_path / "data"),
                     MP_SIZE="2", ZERO_STAGE="3")
    lines = done.stderr.splitlines()
    assert " note: MP_SIZE=2 is not read by this script (it runs one process); " \
           "scripts/pretrain_gpt2_distributed.sh reads it" in lines
    assert " note: ZERO_STAGE=3 is not read by this script (it runs without --deepspeed); " \
           "scripts/ds_pretrain_gpt2.sh reads it" in lines
    done = _run_from(tmp_path, "ds_pretrain_gpt2.sh", tmp_path, DATA_DIR=str(tmp_path / "data"),
                     ZERO_STAGE="3")
    assert "ZERO_STAGE" not in done.stderr  # (read there)


@pytest.mark.parametrize("script", ["pretrain_gpt2.sh", "pretrain_gpt2_distributed.sh",
                                    "generate_text.sh", "setup.sh"])
def test_a_script_run_with_sh_says_to_use_bash(tmp_path, script):
    if subprocess.run(["sh", "-c", "echo ${BASH_VERSION:-}"], capture_output=True,
                      text=True).stdout.strip():
        pytest.skip("sh is bash here")
    done = subprocess.run(["sh", f"scripts/{script}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=clean_environment())
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: run this script with bash: bash scripts/{script}"


def test_the_launch_scripts_are_executable():
    import os
    for script in ("pretrain_gpt2.sh", "pretrain_gpt2_distributed.sh",
                   "pretrain_gpt2_model_parallel.sh", "ds_pretrain_gpt2.sh", "generate_text.sh",
                   "evaluate_zeroshot_gpt2.sh", "prepare_default_data.sh", "setup.sh"):
        assert os.access(REPO / "scripts" / script, os.X_OK), script


def _fake_venv(tmp_path):
    """A VENV whose python prints the folder it runs in and its arguments, one per line."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/usr/bin/env bash\npwd\nprintf "%s\\n" "$@"\n')
    python.chmod(0o755)
    return tmp_path / "venv"


def test_generate_text_reads_load_and_top_p_and_runs_where_it_was_started(tmp_path):
    """--load among the arguments is the checkpoint (it was ignored for the default's
    "no checkpoint" error); --top_p alone is not met by the script's default --top_k (the
    tool refuses both); relative paths are the caller's."""
    (tmp_path / "ck").mkdir()
    done = _run_from(tmp_path, "generate_text.sh", tmp_path, "--load", "ck", "--top_p", "0.9",
                     "--sample-input-file", "prompts.txt", VENV=str(_fake_venv(tmp_path)))
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    assert printed[0] == str(tmp_path)  # (the tool reads prompts.txt from there)
    assert printed[printed.index("--load") + 1] == f"{tmp_path}/ck"
    assert "--top_k" not in printed and "--top_p" in printed
