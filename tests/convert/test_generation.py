"""Text generation: the KV cache gives the recompute path's logits and tokens, at TP=1 and
TP=2; tools/generate_samples.py's modes (input file, unconditional, interactive)."""

import importlib.util
import io
import json
import os
import shutil

import pytest
import torch

from megatron import mpu
from megatron.convert.savers import save_model_weights
from megatron.inference.loading import build_model_from_weights
from megatron.model.kv_cache import KVCache, attach_kv_cache
from megatron.inference import text_generation
from megatron.inference.text_generation import SamplingParams, TextGenerator, top_k_top_p_filter
from tests.convert.conftest import random_weights, tokenized_weights
from tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "generate_samples_tool", os.path.join(REPO, "tools", "generate_samples.py"))
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

GREEDY = SamplingParams(greedy=True, out_seq_length=25)


def _context():
    return torch.randint(0, 301, (2, 7), generator=torch.Generator().manual_seed(2))


def test_cached_logits_equal_a_full_forward():
    model = build_model_from_weights(random_weights())
    tokens = torch.randint(0, 301, (2, 15), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(15).expand(2, 15)
    cache = KVCache.for_model(model, batch_size=2, max_len=15)
    with torch.no_grad(), attach_kv_cache(model, cache):
        # a prompt, one token, then several at once (the explicit-mask path)
        pieces = [model(tokens[:, a:b], positions[:, a:b]) for a, b in ((0, 6), (6, 7), (7, 15))]
    with torch.no_grad():
        full = model(tokens, positions)
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
    assert all(m.kv_cache is None for m in model.modules() if hasattr(m, "kv_cache"))


def _generate(model, use_cache):
    return TextGenerator(model, eod=300, vocab_size=301, use_cache=use_cache).generate(
        _context(), GREEDY)


def test_greedy_generation_with_cache_equals_recompute():
    model = build_model_from_weights(random_weights())
    cached, cached_done = _generate(model, True)
    recomputed, recomputed_done = _generate(model, False)
    assert cached.shape == (2, 25)
    assert torch.equal(cached, recomputed) and torch.equal(cached_done, recomputed_done)


def test_precision_is_the_dtype_of_the_weights():
    """--precision bf16 holds bf16 weights (load_state_dict alone would keep fp32 ones)."""
    model = build_model_from_weights(random_weights(), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    new, _ = _generate(model, True)
    assert new.shape == (2, 25)


def test_a_compiled_decode_step_gives_the_same_tokens_and_compiles_once(monkeypatch):
    """TextGenerator(compile=True): one-token steps over the fixed-shape cache (written at a
    position tensor, the rest masked) give the eager cache's tokens, and the step is compiled
    once for every step of both calls (prompts of 7 and 4 tokens share a cache size)."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(
        fn, **kwargs, backend=counting_backend))
    torch._dynamo.reset()
    model = build_model_from_weights(random_weights(positions=300))
    compiled = TextGenerator(model, eod=300, vocab_size=301, compile=True)
    for context in (_context(), _context()[:, 3:]):
        eager, _ = TextGenerator(model, eod=300, vocab_size=301).generate(context, GREEDY)
        new, _ = compiled.generate(context, GREEDY)
        assert torch.equal(new, eager)
    assert len(graphs) == 1
    assert [cache.max_len for cache in compiled._kept_caches.values()] == [256]


def test_compiling_needs_the_cache():
    model = build_model_from_weights(random_weights())
    with pytest.raises(ValueError, match="needs the KV cache"):
        TextGenerator(model, eod=300, vocab_size=301, use_cache=False, compile=True)


def test_generation_stops_at_the_model_length():
    model = build_model_from_weights(random_weights(positions=12))
    new, _ = TextGenerator(model, eod=300, vocab_size=301).generate(_context(), GREEDY)
    assert new.shape[1] <= 12 - 7


def test_max_length_bounds_the_prompt_and_the_new_tokens():
    model = build_model_from_weights(random_weights(positions=24))
    generator = TextGenerator(model, eod=300, vocab_size=301, max_length=10)
    new, _ = generator.generate(_context(), GREEDY)
    assert new.shape[1] == 10 - 7
    full, _ = TextGenerator(model, eod=300, vocab_size=301).generate(_context(), GREEDY)
    assert torch.equal(new, full[:, :3])  # the same tokens, fewer of them
    for bad in (1, 25):
        with pytest.raises(ValueError, match="must be in 2..24"):
            TextGenerator(model, eod=300, vocab_size=301, max_length=bad)


def test_reading_the_finished_flags_every_few_steps_gives_the_same_tokens(monkeypatch):
    """As on a GPU, where the flags are read every 8 steps: the steps run after every row
    finished are cut off, so the result is that of a read after every step."""
    model = build_model_from_weights(random_weights())
    free_run, _ = TextGenerator(model, eod=-1, vocab_size=301).generate(_context(), GREEDY)
    # an eod that both rows produce, at different steps, the last one before the final step
    firsts = {int(t): [int((row == t).nonzero()[0]) for row in free_run]
              for t in free_run[0] if t in free_run[1]}
    eod, steps = next(((t, s) for t, s in firsts.items()
                       if s[0] != s[1] and max(s) < GREEDY.out_seq_length - 1
                       and (max(s) + 1) % 4 != 0), (None, None))
    assert eod is not None, f"no token that both rows produce at suitable steps: {firsts}"
    every_step, every_step_done = TextGenerator(model, eod, vocab_size=301).generate(
        _context(), GREEDY)
    monkeypatch.setattr(text_generation, "_finished_read_every", lambda device: 4)
    every_fourth, every_fourth_done = TextGenerator(model, eod, vocab_size=301).generate(
        _context(), GREEDY)
    assert every_step.shape[1] == max(steps) + 1 and every_step_done.all()
    assert torch.equal(every_fourth, every_step)
    assert torch.equal(every_fourth_done, every_step_done)


def test_the_steps_after_the_last_row_finished_are_cut_off():
    eod = 9
    generated = torch.tensor([[1, 9, 9, 9, 9, 9], [2, 3, 4, 9, 9, 9]])  # read at step 5
    done = torch.tensor([True, True])
    assert torch.equal(text_generation._until_all_finished(generated, done, eod),
                       generated[:, :4])
    not_done = torch.tensor([True, False])  # a row still going: every step is kept
    unfinished = torch.tensor([[1, 9, 9], [2, 3, 4]])
    assert torch.equal(text_generation._until_all_finished(unfinished, not_done, eod),
                       unfinished)
    empty = torch.zeros(0, 3, dtype=torch.long)
    assert text_generation._until_all_finished(empty, torch.zeros(0, dtype=torch.bool),
                                               eod).shape == (0, 3)


def _tp2_worker(rank, world_size):
    weights = random_weights()  # the full model, built before the TP=2 groups exist
    mpu.initialize_model_parallel(2)
    model = build_model_from_weights(weights)
    # compiled: the decode step's all-reduces (no grad) are traced, so it is one graph
    real_compile = torch.compile
    torch.compile = lambda fn, **kwargs: real_compile(fn, **kwargs, fullgraph=True)
    try:
        compiled, _ = TextGenerator(model, eod=300, vocab_size=301, compile=True).generate(
            _context(), GREEDY)
    finally:
        torch.compile = real_compile
    return [_generate(model, True)[0], _generate(model, False)[0], compiled]


def test_greedy_generation_at_tp2_equals_tp1():
    expected, _ = _generate(build_model_from_weights(random_weights()), True)
    for tokens in run_distributed(_tp2_worker, 2):
        assert all(torch.equal(new, expected) for new in tokens)


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(top_k_top_p_filter(logits, top_k=2)).tolist() == \
        [[False, False, True, True]]
    # cumulative 0.5, 0.8, 0.95: p=0.7 keeps the token that crosses it (0.3)
    assert torch.isinf(top_k_top_p_filter(logits, top_p=0.7)).tolist() == \
        [[False, False, True, True]]
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isinf(top_k_top_p_filter(shuffled, top_p=0.7)).tolist() == \
        [[True, False, True, False]]


# -------------------------------------------------------------------------------- the tool

def _checkpoint(corpus, tmp_path):
    weights, _ = tokenized_weights(corpus, hidden_size=32, num_heads=4, positions=48)
    save_model_weights(weights, str(tmp_path / "ckpt"), "megatron", target_tp=2)
    return str(tmp_path / "ckpt")


def test_generate_samples_tool_modes(corpus, tmp_path, monkeypatch, capsys):
    load = _checkpoint(corpus, tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king said\nsweet love\n")
    out = tmp_path / "out.jsonl"
    base = ["--load", load, "--out-seq-length", "10"]
    assert tool.main(base + ["--sample-input-file", str(prompts), "--sample-output-file",
                             str(out), "--greedy"]) == 0
    greedy = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["context"] for r in greedy] == ["the king said", "sweet love"]
    assert all(0 <= r["length"] <= 10 for r in greedy)
    assert tool.main(base + ["--sample-input-file", str(prompts), "--sample-output-file",
                             str(tmp_path / "re.jsonl"), "--greedy", "--recompute"]) == 0
    assert (tmp_path / "re.jsonl").read_text() == out.read_text()

    genfile = tmp_path / "samples.jsonl"
    assert tool.main(base + ["--num-samples", "3", "--genfile", str(genfile), "--top_k", "5",
                             "--temperature", "0.9", "--batch-size", "2"]) == 0
    samples = [json.loads(line) for line in genfile.read_text().splitlines()]
    assert len(samples) == 3 and set(samples[0]) == {"text", "length", "finished"}

    monkeypatch.setattr("sys.stdin", io.StringIO("the king said\n\nstop\n"))
    assert tool.main(base + ["--greedy"]) == 0
    shown = capsys.readouterr().out
    assert shown.count(tool.PROMPT) == 3 and f"Megatron-LM: {greedy[0]['text']}" in shown
    assert "did not fit" not in shown
    # a prompt longer than the model's 48 positions: cut, as in the file mode, and said so
    monkeypatch.setattr("sys.stdin", io.StringIO("the king said " * 40 + "\nstop\n"))
    assert tool.main(base + ["--greedy"]) == 0
    assert " note: the prompt did not fit 48 positions with room for a new token; only its " \
           "last 47 tokens were read" in capsys.readouterr().out
    assert tool.main(base + ["--sample-input-file", str(prompts), "--sample-output-file",
                             str(out), "--greedy", "--batch-size", "4"]) == 0
    assert " note: --batch-size 4 batches --num-samples; prompts are continued one at a time" \
        in capsys.readouterr().out


def test_samples_are_written_as_they_are_made_and_a_stop_keeps_them(corpus, tmp_path,
                                                                    monkeypatch, capsys):
    """A long prompts file: a line each tenth of the way; stopped at the 23rd prompt, the 22
    samples made are in <output>.partial (no output file: it is only ever whole)."""
    load = _checkpoint(corpus, tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"the king said {i}\n" for i in range(25)))
    out = tmp_path / "out.jsonl"
    argv = ["--load", load, "--out-seq-length", "2", "--greedy", "--sample-input-file",
            str(prompts), "--sample-output-file", str(out)]
    real = tool.generate_text

    def stopped_at_the_23rd(generator, tokenizer, prompt, params):
        if prompt == "the king said 22":
            raise KeyboardInterrupt
        return real(generator, tokenizer, prompt, params)
    monkeypatch.setattr(tool, "generate_text", stopped_at_the_23rd)
    assert tool.main(argv) == 130
    shown = capsys.readouterr().out
    progress = [line.split()[0] for line in shown.splitlines() if " of 25 samples (" in line]
    assert progress == [str(n) for n in range(2, 23, 2)]
    assert f" note: stopped after 22 of 25 samples; they are in {out}.partial" in shown
    assert not out.exists()
    kept = [json.loads(line) for line in (tmp_path / "out.jsonl.partial").read_text().splitlines()]
    assert [record["context"] for record in kept] == [f"the king said {i}" for i in range(22)]
    monkeypatch.setattr(tool, "generate_text", real)
    assert tool.main(argv) == 0
    assert f" wrote 25 samples to {out}" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 25
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_generation_from_pipeline_stages_equals_one_file(corpus, tmp_path, capsys):
    """A checkpoint of TP 2 x PP 2 files generates what its single-file form does: the
    loader joins the stages as it reads them (Megatron's --pipeline-model-parallel-size,
    which its scripts pass, is taken with a note)."""
    weights, _ = tokenized_weights(corpus, hidden_size=32, num_heads=4, positions=48)
    staged, whole = str(tmp_path / "staged"), str(tmp_path / "whole")
    save_model_weights(weights, staged, "megatron", target_tp=2, target_pp=2)
    save_model_weights(weights, whole, "megatron")
    assert any(name.endswith("_001") for name in os.listdir(os.path.join(staged, "release")))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king said\n")
    outputs = []
    for load in (staged, whole):
        out = tmp_path / f"{os.path.basename(load)}.jsonl"
        stages = ["--pipeline-model-parallel-size", "2"] if load == staged else []
        assert tool.main(["--load", load, "--out-seq-length", "8", "--greedy", *stages,
                          "--sample-input-file", str(prompts),
                          "--sample-output-file", str(out)]) == 0
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
    assert capsys.readouterr().out.count(" note: --pipeline-model-parallel-size 2: inference "
                                         "runs the whole model on each tensor-parallel rank") == 1
    assert tool.main(["--load", staged, "--pipeline-model-parallel-size", "0", "--greedy"]) == 2
    assert "--pipeline-model-parallel-size must be positive, got 0" in capsys.readouterr().err
    for folder in ("mp_rank_00_001", "mp_rank_01_001"):  # one stage's folders left
        shutil.rmtree(os.path.join(staged, "release", folder))
    assert tool.main(["--load", staged, "--greedy", "--sample-input-file", str(prompts)]) == 2
    assert "should hold mp_rank_00_000, mp_rank_00_001, mp_rank_01_000, mp_rank_01_001 " \
           "(model_parallel_size 2 x pipeline_model_parallel_size 2), but holds " \
           "mp_rank_00_000, mp_rank_01_000: the checkpoint is incomplete" \
           in capsys.readouterr().err  # (it named a mp_rank_00/ file that never existed)


def test_generate_samples_bad_flags(corpus, tmp_path, capsys):
    load = _checkpoint(corpus, tmp_path)
    assert tool.main(["--load", load, "--num-samples", "2"]) == 2
    assert "--genfile" in capsys.readouterr().err
    assert tool.main(["--load", load, "--top_k", "3", "--top_p", "0.5"]) == 2
    assert tool.main(["--load", str(tmp_path), "--greedy"]) == 2
    assert "understood formats" in capsys.readouterr().err
    assert tool.main(["--load", load, "--greedy", "--tokenizer-model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: --tokenizer-model names a file that the "
                                              "GPT2BPETokenizer in use does not read")
    for flag, value in (("--threads", "-3"), ("--threads", "0"), ("--model-parallel-size", "0")):
        assert tool.main(["--load", load, "--greedy", flag, value]) == 2
        assert capsys.readouterr().err == f"error: {flag} must be positive, got {value}\n"
    assert tool.main(["--load", load, "--greedy", "--threads", str(2 ** 40)]) == 2  # ValueError
    assert capsys.readouterr().err == (f"error: --threads {2 ** 40} is out of range (at most "
                                       f"{2 ** 31 - 1})\n")
    for seed in ("-1", str(2 ** 40)):  # numpy's ValueError and a traceback
        assert tool.main(["--load", load, "--greedy", "--seed", seed]) == 2
        assert capsys.readouterr().err == f"error: --seed must be from 0 to {2 ** 31 - 1}, " \
                                          f"got {seed}\n"


def test_a_tiny_temperature_samples_the_most_likely_token():
    """logits / 1e-40 overflowed to inf and softmax to NaN: torch.multinomial's error."""
    from megatron.inference.text_generation import SamplingParams, choose_tokens
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, -1.0, 4.9]])
    for temperature in (1e-40, 1e-300):
        chosen = choose_tokens(logits, SamplingParams(temperature=temperature))
        assert chosen.tolist() == [1, 0]


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffthe king\nthe queen\n".encode("utf-8"))
    assert tool.read_prompts(str(path)) == ["the king", "the queen"]


def test_generate_samples_checks_its_files_before_loading_the_model(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king said\n")
    (tmp_path / "folder").mkdir()
    missing = str(tmp_path / "no-such-checkpoint")  # each error comes before --load is read
    cases = [
        (["--sample-input-file", str(prompts), "--sample-output-file", str(prompts)],
         "is also an input file: writing it would replace what it reads"),
        (["--sample-input-file", str(tmp_path / "folder")], "is a directory"),
        (["--num-samples", "2", "--genfile", str(tmp_path / "folder")], "is a directory"),
        (["--num-samples", "2", "--genfile", str(tmp_path / "nodir" / "s.jsonl")],
         "nodir does not exist"),
        (["--genfile", str(tmp_path / "s.jsonl")], "give --num-samples N with N at least 1"),
        (["--temperature", "nan"], "--temperature must be a number > 0 (got nan)"),
        (["--num-samples", "2", "--genfile", str(tmp_path / "s.jsonl"), "--sample-input-file",
          str(prompts)], "--num-samples N writes unconditional samples (no prompts) and "
                         "--sample-input-file continues prompts: drop --num-samples and "
                         "--genfile to continue the prompts, or drop --sample-input-file for "
                         "unconditional samples"),
        (["--sample-output-file", str(tmp_path / "o.jsonl")],
         "add --sample-input-file, or drop --sample-output-file"),
        (["--num-samples", "2", "--genfile", str(tmp_path / "s.jsonl"), "--sample-output-file",
          str(tmp_path / "o.jsonl")], "add --sample-input-file, or drop --sample-output-file"),
        (["--greedy", "--top_k", "3", "--temperature", "5"],
         "--greedy takes the most likely token, which --top_k and --temperature would not "
         "change: drop them, or drop --greedy to sample"),
        (["--greedy", "--top_p", "0.9"], "--greedy takes the most likely token, which --top_p "
                                         "would not change: drop it, or drop --greedy"),
    ]
    for flags, message in cases:
        assert tool.main(["--load", missing, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (flags, err)
    assert prompts.read_text() == "the king said\n"
    (tmp_path / "blank.txt").write_text("\n  \n")
    for empty in ("blank.txt", "empty.txt"):
        (tmp_path / empty).touch()
        assert tool.main(["--load", missing, "--sample-input-file", str(tmp_path / empty)]) == 2
        assert capsys.readouterr().err == (f"error: --sample-input-file {tmp_path / empty} "
                                           "holds no prompts (no line that is not blank)\n")


def test_generate_samples_says_what_the_model_length_cuts(corpus, tmp_path, capsys):
    load = _checkpoint(corpus, tmp_path)  # 48 positions
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king said " * 40 + "\nsweet love\n")
    assert tool.main(["--load", load, "--out-seq-length", "100", "--greedy",
                      "--sample-input-file", str(prompts),
                      "--sample-output-file", str(tmp_path / "out.jsonl")]) == 0
    said = capsys.readouterr().out
    assert "--out-seq-length 100, but the prompt and the new tokens together fit the model's " \
        "48 positions: at most 47 new tokens" in said
    assert "1 of the prompts did not fit the model's 48 positions" in said
    (tmp_path / "bad.txt").write_bytes(b"the king \xff\n")
    assert tool.main(["--load", load, "--greedy", "--sample-input-file",
                      str(tmp_path / "bad.txt")]) == 2
    assert "is not UTF-8 text (byte 9)" in capsys.readouterr().err


def test_generate_samples_seq_length_bounds_prompt_and_new_tokens(corpus, tmp_path, capsys):
    """As in Megatron, --seq-length bounds the prompt and the new tokens together."""
    load = _checkpoint(corpus, tmp_path)  # 48 positions
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the king said " * 10 + "\n")
    out = tmp_path / "out.jsonl"
    assert tool.main(["--load", load, "--seq-length", "16", "--out-seq-length", "100",
                      "--greedy", "--sample-input-file", str(prompts),
                      "--sample-output-file", str(out)]) == 0
    said = capsys.readouterr().out
    assert "--out-seq-length 100, but the prompt and the new tokens together fit " \
        "--seq-length 16: at most 15 new tokens" in said
    assert "1 of the prompts did not fit --seq-length 16 with room for a new token" in said
    record = json.loads(out.read_text())
    assert record["context_truncated_to_tokens"] == 15 and record["length"] <= 1
    assert tool.main(["--load", load, "--seq-length", "1", "--greedy"]) == 2
    assert capsys.readouterr().err == ("error: --seq-length bounds the prompt and the new "
                                       "tokens together: at least 2 (got 1)\n")


def test_generate_samples_takes_megatrons_shape_flags_and_checks_them(corpus, tmp_path,
                                                                      capsys):
    """Megatron's generation script passes the model's shape: the same flags are accepted
    when they match the checkpoint and are one clear error when they do not."""
    load = _checkpoint(corpus, tmp_path)
    genfile = tmp_path / "samples.jsonl"
    shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--max-position-embeddings", "48", "--seq-length", "48"]
    assert tool.main(["--load", load, *shape, "--num-samples", "1", "--genfile", str(genfile),
                      "--out-seq-length", "4"]) == 0
    capsys.readouterr()
    assert tool.main(["--load", load, "--num-layers", "3", "--hidden-size", "64", "--greedy"]) \
        == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --load {load} holds another model than the flags describe: "
                          "--num-layers 3 (the checkpoint: 2); --hidden-size 64 (the "
                          "checkpoint: 32)")
    assert tool.main(["--load", load, "--seq-length", "64", "--greedy"]) == 2
    assert "--seq-length 64 is longer than the checkpoint's --max-position-embeddings 48" in \
        capsys.readouterr().err
