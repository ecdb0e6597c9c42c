"""Zero-shot evaluation against values computed by hand on a tiny model and tiny files."""

import importlib.util
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.inference import zeroshot
from megatron.convert.savers import save_model_weights
from megatron.errors import DataError
from megatron.inference.loading import build_model_from_weights
from tests.convert.conftest import tokenized_weights

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "evaluate_gpt2_tool", os.path.join(REPO, "tools", "evaluate_gpt2.py"))
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

WIKI = (" = Valkyria = \n \n The game @-@ play , began in 2011 . It was ( very ) "
        "popular ; \" fans \" said so . \n")


@pytest.fixture(scope="module")
def setup(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("zeroshot")
    weights, tokenizer = tokenized_weights(corpus, hidden_size=32, num_heads=4, positions=16)
    save_model_weights(weights, str(root / "ckpt"), "megatron")
    model = build_model_from_weights(weights)
    return dict(root=root, tokenizer=tokenizer, model=model, load=str(root / "ckpt"))


def _log_probs(model, tokens, vocab):
    """log p(next token) at every position of one context, the straightforward way."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0))
    return F.log_softmax(logits[0, :, :vocab].double(), dim=-1)


def test_detokenizer_rules():
    assert zeroshot.wikitext_detokenizer(WIKI) == (
        " = Valkyria =\n\nThe game-play, began in 2011. It was (very) popular; \"fans\" "
        "said so.\n")


def test_window_layout_scores_every_target_once():
    windows = zeroshot.window_starts(num_tokens=20, seq_length=8, stride=4)
    assert windows == [(0, 1, 8), (4, 9, 12), (8, 13, 16), (12, 17, 19)]
    scored = [t for _, first, last in windows for t in range(first, last + 1)]
    assert scored == list(range(1, 20))


def test_wikitext_perplexity_equals_hand_computation(setup, tmp_path):
    tokenizer, model = setup["tokenizer"], setup["model"]
    vocab = tokenizer.vocab_size
    tokens = tokenizer.tokenize(zeroshot.wikitext_detokenizer(WIKI))
    assert len(tokens) > 20
    # seq 8, stride 4: target t is scored in the window starting at start(t), with the
    # context tokens[start(t):t]
    windows = zeroshot.window_starts(len(tokens), 8, 4)
    nll = 0.0
    for start, first, last in windows:
        for target in range(first, last + 1):
            nll -= _log_probs(model, tokens[start:target], vocab)[-1, tokens[target]].item()
    words = len(WIKI.strip().split(" "))
    path = tmp_path / "wiki.test.tokens"
    path.write_text(WIKI)
    results = tool.main(["--load", setup["load"], "--task", "WIKITEXT103", "--valid-data",
                         str(path), "--seq-length", "8", "--overlapping-eval", "4",
                         "--results-file", str(tmp_path / "r.json")])
    assert results == 0
    result = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert result["num_tokenized_tokens"] == len(tokens)
    assert result["num_original_tokens"] == words
    assert result["ppl"] == pytest.approx(math.exp(nll / (len(tokens) - 1)), rel=1e-5)
    assert result["adjusted_ppl"] == pytest.approx(math.exp(nll / (words - 1)), rel=1e-5)


def test_lambada_accuracy_equals_hand_computation(setup, tmp_path):
    tokenizer, model = setup["tokenizer"], setup["model"]
    vocab = tokenizer.vocab_size
    passages = ["the king said to the queen that love", "sweet night of gold and fire",
                "the brother and sister went to sea", "thou shall speak of honour"]
    expected = {}
    for strict in (False, True):
        correct = 0
        for text in passages:
            if strict:
                last = text.split()[-1]
                context = tokenizer.tokenize(text[:text.rfind(last)].strip())
                target = tokenizer.tokenize(" " + last)
            else:
                ids = tokenizer.tokenize(text)
                context, target = ids[:-1], ids[-1:]
            sequence = (context + target)[-17:]
            log_probs = _log_probs(model, sequence[:-1], vocab)
            correct += log_probs[-len(target):].argmax(-1).tolist() == target
        expected[strict] = correct
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in passages))
    for strict in (False, True):
        for batch in ("1", "3"):  # passages of other lengths in one batch
            out = tmp_path / f"r{strict}.json"
            argv = ["--load", setup["load"], "--task", "LAMBADA", "--valid-data", str(path),
                    "--results-file", str(out), "--batch-size", batch] + \
                (["--strict-lambada"] if strict else [])
            assert tool.main(argv) == 0
            result = json.loads(out.read_text())["results"][0]
            assert (result["correct"], result["total"]) == (expected[strict], 4)


def test_lambada_strict_targets_the_whole_last_word(setup):
    tokenizer = setup["tokenizer"]
    context, target = zeroshot.lambada_example(tokenizer, "the king said \u201cbrotherhood\u201d",
                                                strict=True)
    # the last whitespace-separated word, quotes included (straightened)
    assert tokenizer.detokenize(target) == ' "brotherhood"'
    assert tokenizer.detokenize(context) == 'the king said'
    _, last_token = zeroshot.lambada_example(tokenizer, "the king said brotherhood", False)
    assert len(last_token) == 1


def test_bad_evaluation_inputs(setup, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "no text field"}\n')
    assert tool.main(["--load", setup["load"], "--task", "LAMBADA", "--valid-data",
                      str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert tool.main(["--load", setup["load"], "--task", "WIKITEXT103", "--valid-data",
                      str(tmp_path / "missing.tokens")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"^--overlapping-eval 9 must lie in \[1, 8\], the "
                                        r"window .*: lower it \(in scripts/evaluate_zeroshot_"
                                        r"gpt2.sh: OVERLAP\)$"):
        zeroshot.evaluate_wikitext(None, setup["tokenizer"], WIKI, 8, overlapping_eval=9)
    for record in ('{"text": 5}', '{"text": null}', '{"text": "   "}'):
        bad.write_text('{"text": "the king said brotherhood"}\n' + record + "\n")
        assert tool.main(["--load", setup["load"], "--task", "LAMBADA", "--valid-data",
                          str(bad), "--strict-lambada"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}:2 is not a JSON object with a non-blank 'text' "
                              "string") and "Traceback" not in err, record
    bad.write_text('{"text": "the king said \u201cbrotherhood\u201d"}\n')
    assert tool.main(["--load", setup["load"], "--task", "LAMBADA", "--valid-data", str(bad),
                      "--strict-lambada", "--seq-length", "1"]) == 2
    err = capsys.readouterr().err
    assert "more than --seq-length 1 can score: give --seq-length" in err, err


def test_a_seq_length_too_short_for_the_targets_names_the_one_that_scores_them_all(setup,
                                                                                  tmp_path,
                                                                                  capsys):
    tokenizer = setup["tokenizer"]
    passages = ["the king said brotherly", "the king said \u201cbrotherhood\u201d"]
    lengths = [len(zeroshot.lambada_example(tokenizer, p, strict=True)[1]) for p in passages]
    assert 1 < lengths[0] < lengths[1], lengths  # the first is too long too, not the longest
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages))
    argv = ["--load", setup["load"], "--task", "LAMBADA", "--valid-data", str(path),
            "--strict-lambada", "--seq-length"]
    for seq_length in range(1, lengths[1]):  # was an IndexError
        assert tool.main(argv + [str(seq_length)]) == 2
        assert capsys.readouterr().err == (
            f"error: the last word of LAMBADA passage {passages[1]!r} is {lengths[1]} tokens, "
            f"more than --seq-length {seq_length} can score: give --seq-length {lengths[1]} or "
            "more (the longest target of the passages)\n")
    assert tool.main(argv + [str(lengths[1])]) == 0


def test_a_file_of_the_other_task_or_not_text_is_refused_before_loading(tmp_path, capsys):
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text(json.dumps({"text": "the king said brotherhood"}) + "\n")
    binary = tmp_path / "corpus.bin"
    binary.write_bytes(b"the \xff\xfe\x00 king")
    cases = [("WIKITEXT103", lambada, "holds JSON lines, LAMBADA's format"),
             ("WIKITEXT103", binary, "is not UTF-8 text (byte 4), so not a WikiText file"),
             ("LAMBADA", binary, "is not UTF-8 text (byte 4), so not a LAMBADA file")]
    for task, path, message in cases:
        assert tool.main(["--load", str(tmp_path / "no-checkpoint"), "--task", task,
                          "--valid-data", str(path)]) == 2
        assert message in capsys.readouterr().err


def test_window_flags_and_the_results_file_are_checked_before_loading(tmp_path, capsys):
    wiki = tmp_path / "wiki.tokens"
    wiki.write_text(WIKI)
    base = ["--load", str(tmp_path / "no-checkpoint"), "--task", "WIKITEXT103", "--valid-data",
            str(wiki)]
    cases = [(["--seq-length", "0"], "--seq-length must be at least 1, got 0"),
             (["--overlapping-eval", "0"], "--overlapping-eval must be at least 1, got 0"),
             (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
             (["--log-interval", "0"], "--log-interval must be at least 1, got 0"),
             (["--results-file", str(tmp_path / "nodir" / "r.json")], "nodir does not exist"),
             (["--results-file", str(wiki)], "is also an input file")]
    for flags, message in cases:
        assert tool.main(base + flags) == 2
        assert message in capsys.readouterr().err
    assert wiki.read_text() == WIKI


def test_batched_scoring_gives_each_sequence_its_own_log_probs(setup):
    """Right padding to the longest of a batch changes no row: compared with one sequence
    per forward, for sequences of different lengths and rows anywhere in them."""
    model, vocab = setup["model"], setup["tokenizer"].vocab_size
    score = zeroshot.model_score_fn(model, vocab)
    requests = [(list(range(3, 3 + n)), range(n - k, n)) for n, k in
                ((5, 2), (12, 12), (1, 1), (9, 3), (16, 4))]
    alone = list(zeroshot.scored_rows(score, requests, 1, len(requests)))
    seen = []
    batched = list(zeroshot.scored_rows(score, requests, 3, len(requests),
                                        progress=lambda done, total: seen.append((done, total))))
    assert seen == [(3, 5), (5, 5)]
    for (ids, rows), one, many in zip(requests, alone, batched):
        assert one.shape == many.shape == (len(rows), vocab)
        torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)


def test_megatrons_evaluation_command_line_runs_and_batches_change_no_metric(setup, tmp_path,
                                                                          capsys):
    """The flags Megatron's evaluate_zeroshot_gpt2.sh passes (--batch-size 8
    --checkpoint-activations --log-interval 10 --fp16 --no-load-optim --no-load-rng)."""
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text(WIKI * 3)
    base = ["--load", setup["load"], "--task", "WIKITEXT103", "--valid-data", str(wiki),
            "--seq-length", "8", "--overlapping-eval", "3"]
    results = {}
    for name, flags in (("one", []), ("batched", ["--batch-size", "4", "--log-interval", "2"]),
                        ("megatron", ["--batch-size", "8", "--checkpoint-activations",
                                      "--log-interval", "10", "--fp16", "--no-load-optim",
                                      "--no-load-rng"])):
        out = tmp_path / f"{name}.json"
        assert tool.main(base + flags + ["--results-file", str(out)]) == 0, name
        results[name] = json.loads(out.read_text())["results"][0]
    printed = capsys.readouterr().out
    assert " WIKITEXT103 " in printed and "windows 8/" in printed and "| elapsed " in printed
    assert results["batched"]["ppl"] == pytest.approx(results["one"]["ppl"], rel=1e-5)
    assert results["megatron"]["ppl"] == pytest.approx(results["one"]["ppl"], rel=2e-2)
    with pytest.raises(SystemExit):  # two precisions: argparse's usage error
        tool.get_args(base + ["--fp16", "--precision", "bf16"])


def test_a_byte_order_mark_does_not_hide_the_first_lambada_line(tmp_path):
    """A file saved with a BOM: its first line was 'not a JSON object'."""
    path = tmp_path / "lambada.jsonl"
    path.write_bytes(("\ufeff" + json.dumps({"text": "the king spoke"}) + "\n").encode("utf-8"))
    assert zeroshot.read_lambada(str(path)) == ["the king spoke"]
