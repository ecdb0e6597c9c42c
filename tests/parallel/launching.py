"""Run the real trainer (pretrain_gpt2.py) in several processes, with launcher variables or
under torchrun, and read back what it wrote.  Shared by test_layouts.py and test_launch.py.

Every process gets one CPU thread: the test machine has two cores and runs up to four ranks.
"""

import json
import os
import random
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from tests.dist_utils import REPO, free_port, start_process

PYTHON = sys.executable
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")

# 2 layers, hidden 32, 4 heads: divisible by tensor-parallel sizes 1, 2 and 4.  Dropout 0 so
# that every layout computes the same function.
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "32", "--max-position-embeddings", "32"]
TRAINING = ["--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
            "--warmup-iters", "2", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
            "--num-workers", "0", "--split", "90,9,1", "--threads", "1", "--seed", "1234"]

_WORDS = ("the king queen lord night day love death sword crown honour heaven earth thou "
          "shall speak would come go hath good sweet fair noble brother sister father mother "
          "friend war peace gold land sea ship storm wind fire water stone").split()


def build_corpus(data_dir):
    """Synthetic text -> 512-token BPE -> .bin/.idx, in the file layout of
    scripts/prepare_default_data.sh (so the launch scripts find it as DATA_DIR)."""
    from megatron.data.preprocessing import ConstantFactory, tokenize_loose_json
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.bpe_trainer import (count_pretokens, train_byte_level_bpe,
                                                write_gpt2_files)
    rng = random.Random(0)
    texts = [_document(rng) for _ in range(200)]
    webtext = Path(data_dir) / "webtext"
    webtext.mkdir(parents=True)
    with open(webtext / "data.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    vocab, merges = write_gpt2_files(train_byte_level_bpe(count_pretokens(texts), vocab_size=512),
                                     str(Path(data_dir) / "tokenizer"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    tokenize_loose_json(str(webtext / "data.json"), str(webtext / "webtext"),
                        ConstantFactory(tokenizer), append_eod=True)
    return {"data_dir": str(data_dir), "vocab": vocab, "merges": merges,
            "prefix": str(webtext / "webtext_text_document")}


def _document(rng):
    sentences = [" ".join(rng.choices(_WORDS, k=rng.randint(4, 14))).capitalize() + "."
                 for _ in range(rng.randint(4, 12))]
    return " ".join(sentences)


def trainer_argv(corpus, log_dir, iters, *extra):
    return TINY_MODEL + TRAINING + [
        "--train-iters", str(iters), "--data-path", corpus["prefix"],
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", corpus["vocab"],
        "--merge-file", corpus["merges"], "--log-dir", str(log_dir)] + [str(a) for a in extra]


# Enough flags to parse; nothing reads the files (no model or data is built with them).
FLAGS_FOR_SETUP_ONLY = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                        "--seq-length", "8", "--batch-size", "1", "--train-iters", "1",
                        "--lr", "1e-3", "--data-path", "unused", "--tokenizer-type",
                        "SentencePieceTokenizer", "--tokenizer-model", "unused"]


def clean_environment(**overrides):
    """os.environ without launcher variables inherited from whatever runs pytest."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "OMPI_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def torchrun_variables(world_size):
    def rank_env(rank, port):
        return dict(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank,
                    LOCAL_WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return rank_env


def launch_ranks(argv, world_size, out_dir, rank_env=None, timeout=120):
    """Run `pretrain_gpt2.main(argv)` in `world_size` processes; return [(exit code, output)].

    Each rank gets torchrun's variables (or `rank_env(rank, port)`).  A launcher forked from
    the tests' fork server (tests/dist_utils.py: torch and the trainer imported once per
    session) forks the ranks: the same processes as `python pretrain_gpt2.py` started per
    rank, without paying the ~5 s of imports per launch (four ranks share two cores here).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher = start_launcher(argv, world_size, out_dir, rank_env, out_dir / "launcher.out")
    try:
        launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks still running after {timeout}s: "
                             f"{(out_dir / 'rank0.out').read_text()[-2000:]}") from None
    finally:
        kill_session(launcher)
    assert launcher.returncode == 0, (out_dir / "launcher.out").read_text()
    codes = json.loads((out_dir / "exit_codes.json").read_text())
    return [(code, (out_dir / f"rank{r}.out").read_text()) for r, code in enumerate(codes)]


def start_launcher(argv, world_size, out_dir, rank_env=None, output=os.devnull):
    """Start launch_ranks' launcher and return at once (a handle like subprocess.Popen's):
    rank r's output goes to out_dir/rank{r}.out, the exit codes to out_dir/exit_codes.json."""
    port = free_port()
    rank_env = rank_env or torchrun_variables(world_size)
    job = {"argv": [str(a) for a in argv], "out_dir": str(out_dir),
           "rank_env": [{k: str(v) for k, v in rank_env(r, port).items()}
                        for r in range(world_size)]}
    return start_process(_fork_ranks, (job,), env=clean_environment(), cwd=REPO, output=output)


def _fork_ranks(job):
    """The launcher process of launch_ranks."""
    import pretrain_gpt2
    pids = []
    for rank, env in enumerate(job["rank_env"]):
        pids.append(fork_trainer(pretrain_gpt2.main, job["argv"], env,
                                 Path(job["out_dir"]) / f"rank{rank}.out"))
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    (Path(job["out_dir"]) / "exit_codes.json").write_text(json.dumps(codes))


def fork_trainer(main, argv, env, out_path):
    """Fork a child that runs main(argv) with `env` added to its environment, its stdout and
    stderr to `out_path`, and exits with main's exit code (1 on an exception); its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(env)
        code = main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start_torchrun(argv, nproc, out_path):
    """Popen of `torchrun --standalone --nproc_per_node N pretrain_gpt2.py argv`."""
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nproc), "pretrain_gpt2.py", *argv]
    with open(out_path, "w") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=clean_environment(), start_new_session=True)


def run_torchrun(argv, nproc, out_path, timeout=120):
    proc = start_torchrun(argv, nproc, out_path)
    try:
        proc.wait(timeout=timeout)
    finally:
        kill_session(proc)
    return proc.returncode, Path(out_path).read_text()


def kill_session(proc):
    """Kill a launcher started with start_new_session, and whatever it left running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the launcher and all it started have exited
        pass
    proc.wait()


def read_metrics(log_dir):
    """{iteration: (lm_loss, grad_norm)} from metrics.jsonl, training records only."""
    with open(Path(log_dir) / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in records if "lm_loss" in r}


def read_params_norms(log_dir):
    """{iteration: params_norm} from metrics.jsonl of a run with --log-params-norm."""
    with open(Path(log_dir) / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["params_norm"] for r in records if "params_norm" in r}


def assert_same_params_norms(reference_log_dir, log_dir, tolerance=1e-5):
    """The weights' norms (--log-params-norm) of two runs of the same training agree: each
    layout counts every weight once."""
    reference, norms = read_params_norms(reference_log_dir), read_params_norms(log_dir)
    assert norms and sorted(norms) == sorted(reference)
    for it, norm in norms.items():
        assert relative_difference(norm, reference[it]) < tolerance, (it, norm, reference[it])


def relative_difference(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)
