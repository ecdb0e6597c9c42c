"""The README's shell blocks stay true: every command is either run as written (scaled down to
tiny sizes) in a copy of the repository, or listed in NOT_RUN with the reason.

The quick test checks that each command is classified, that the files it names exist and that
the pretrain_gpt2.py flags it passes are flags. The other runs them all (3-6 minutes on 2
cores), in README order, after the data pipeline block (so later commands use its tokenizer);
a command that fails, prints a traceback or trains nothing is reported with its output.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron.config.flags import build_parser
from tests.parallel.launching import REPO, build_corpus, clean_environment, free_port

README = Path(REPO) / "README.md"

# command prefix -> why the test does not run it
NOT_RUN = {
    "bash scripts/test.sh": "the test suite itself",
    "EXTRAS=webtext bash scripts/setup.sh": "installs packages (scripts/test.sh installed them)",
    "PAGES=my_pages/": "the user's own pages and URL lists",
    ".venv/bin/python tools/build_index_maps.py --world-size 8 <": "a placeholder for flags",
    ".venv/bin/torchrun --standalone --nproc_per_node 4 pretrain_gpt2.py --model-parallel-size "
    "2 <flags above>": "a placeholder for flags",
    ".venv/bin/torchrun --standalone --nproc_per_node 4 pretrain_gpt2.py "
    "--pipeline-model-parallel-size 2": "a placeholder for flags",
    "NNODES=2 NODE_RANK=": "two machines (tests/parallel/test_launch.py runs two local nodes)",
    "NNODES=2 RDZV_ENDPOINT=node0": "two machines (tests/parallel/test_launch.py runs two "
                                    "local nodes)",
    "export MASTER_ADDR=$(scontrol": "a SLURM allocation",
    "srun ": "a SLURM allocation",
    "WIKITEXT_FILE=": "the user's WikiText-103 and LAMBADA files and a Hugging Face GPT-2",
    ".venv/bin/python benchmarks/": "benchmarks measure and are run by hand "
                                    "(docs/benchmarks.md holds their results)",
    "bash benchmarks/": "benchmarks measure and are run by hand",
    ".venv/bin/python tools/merge_mp_partitions.py --deepspeed --load $MDS":
        "a Megatron-DeepSpeed checkpoint (tests/convert/test_megatron_deepspeed_checkpoints.py "
        "makes one and converts it)",
    ".venv/bin/python pretrain_gpt2.py --load checkpoints/from_mds": "the Megatron-DeepSpeed "
                                                                    "checkpoint above",
}
# the data pipeline block runs first: later commands train with its tokenizer
FIRST = ".venv/bin/python tools/train_tokenizer.py"
# tiny sizes for the scripts (their variables) and for the flags written out in commands
SCALED_ENV = dict(NLAYERS=2, NHIDDEN=64, NHEADS=4, SEQ_LEN=64, TRAIN_ITERS=4, WARMUP_ITERS=1,
                  LOG_INTERVAL=2, EVAL_INTERVAL=4, EVAL_ITERS=1, SUB_GROUP=1000)
SCALED_FLAGS = {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4,
                "--seq-length": 64, "--max-position-embeddings": 64, "--batch-size": 2,
                "--train-iters": 4, "--save-interval": 2, "--eval-interval": 4,
                "--eval-iters": 1, "--exit-interval": 2, "--vocab-size": 1024}
SCALED_VARIABLES = {"TRAIN_ITERS": 4, "GPUS_PER_NODE": 4}
# The scripts' precision when a command names none: each start would otherwise run the
# precision probe (2-6 s a start, most of it on CPUs that only emulate bf16); the README's
# first command still probes, as a new user's run does, and the DeepSpeed scripts keep their
# default (their JSON's precision).
PROBED = "bash scripts/pretrain_gpt2.sh"
UNPROBED_ENV = dict(PRECISION="fp32")


def _precision_env(command):
    return {} if command == PROBED or "scripts/ds_" in command else UNPROBED_ENV
# what an interactive command reads
STDIN = {"bash scripts/generate_text.sh": "The king\nstop\n"}
# files a command expects the user to have
USER_FILES = {"prompts.txt": "The king said\nThe queen\n"}


def readme_commands():
    """[(line, command)] of every ```bash block, continuation lines joined and comments
    dropped; a shell loop (for ... done) is one command."""
    text = README.read_text()
    commands = []
    for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
        first_line = text[:block.start()].count("\n") + 2
        pending, start, depth = "", None, 0
        for offset, raw in enumerate(block.group(1).splitlines()):
            line = _strip_comment(raw).rstrip()
            if not line.strip() and not pending:
                continue
            start = first_line + offset if start is None else start
            depth += len(re.findall(r"^\s*(for|while)\b", line)) - \
                len(re.findall(r"\bdone\b", line))
            if line.endswith("\\") or depth > 0 or pending.count('"') % 2:
                pending += line.rstrip("\\") + (" " if line.endswith("\\") else "\n")
                continue
            commands.append((start, " ".join((pending + line).split(" ")).strip()))
            pending, start = "", None
    return commands


def _strip_comment(line):
    """The line without a trailing `# comment` (a `#` inside quotes or $(...) stays)."""
    quoted = False
    for i, char in enumerate(line):
        if char in "\"'":
            quoted = not quoted
        elif char == "#" and not quoted and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def _reason_not_run(command):
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


def _scaled(command):
    for flag, value in SCALED_FLAGS.items():
        command = re.sub(rf"{flag} [0-9.e]+\b", f"{flag} {value}", command)
    for name, value in SCALED_VARIABLES.items():
        command = re.sub(rf"\b{name}=\d+", f"{name}={value}", command)
    return command


def test_every_readme_command_is_run_or_says_why_not():
    commands = readme_commands()
    assert len(commands) > 30
    known = {s for action in build_parser()._actions for s in action.option_strings}
    for line, command in commands:
        if _reason_not_run(command):
            continue
        for path in re.findall(r"(?:^|\s)((?:scripts|tools|benchmarks)/[\w./-]+\.(?:sh|py))",
                               command):
            assert (Path(REPO) / path).is_file(), f"README line {line}: {path} does not exist"
        if "pretrain_gpt2.py" in command:
            flags = re.findall(r"(?:^|\s)(--[a-z][\w-]*)", command.split("pretrain_gpt2.py", 1)[1])
            unknown = [f for f in flags if f not in known]
            assert not unknown, f"README line {line}: {unknown} are not pretrain_gpt2.py flags"
        assert not re.match(r"(python|torchrun|pip) ", command), \
            f"README line {line}: a bare `{command.split()[0]}` is not the venv's"


def _repository_files():
    """The checkout's files (tracked and new, not ignored); without git, every file outside
    what a run or setup makes."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True)
    if listed.returncode == 0:
        return [name for name in listed.stdout.split("\n") if name]
    made = {".git", ".venv", "data", "checkpoints", "runs", "hf"}  # at the top level
    names = [path.relative_to(REPO) for path in Path(REPO).rglob("*") if path.is_file()]
    return [str(name) for name in names
            if name.parts[0] not in made and "__pycache__" not in name.parts]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """A copy of the repository's files (the venv linked), with a tiny corpus in data/."""
    root = tmp_path_factory.mktemp("readme") / "repo"
    for name in _repository_files():
        source = Path(REPO) / name
        if source.is_file() and not name.startswith("data/"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    (root / ".venv").symlink_to(Path(REPO) / ".venv")
    build_corpus(root / "data")
    for name, text in USER_FILES.items():
        (root / name).write_text(text)
    return root


def test_readme_commands_run_as_written(sandbox):
    commands = [(line, c) for line, c in readme_commands() if not _reason_not_run(c)]
    commands.sort(key=lambda item: not item[1].startswith(FIRST))  # stable: README order
    failures = []
    for line, command in commands:
        scaled = _scaled(command)
        env = clean_environment(**SCALED_ENV, **_precision_env(command),
                                MASTER_PORT=free_port())
        env.pop("OMP_NUM_THREADS")
        stdin = next((text for prefix, text in STDIN.items()
                      if command.startswith(prefix) and "--sample-input-file" not in command
                      and "--num-samples" not in command and "--greedy" not in command), "")
        done = subprocess.run(["bash", "-c", scaled], cwd=sandbox, env=env, input=stdin,
                              capture_output=True, text=True, timeout=600)
        output = done.stdout + done.stderr
        if done.returncode != 0 or "Traceback" in output or "nothing to train" in output:
            failures.append(f"README line {line}: `{scaled}` exited {done.returncode}:\n"
                            + output[-2500:])
    assert not failures, "\n\n".join(failures)
