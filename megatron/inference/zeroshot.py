"""Zero-shot evaluation of a GPT-2: WikiText-103 perplexity and LAMBADA accuracy.

WikiText-103 (`wiki.test.tokens`, word-level, " @-@ " style):
    the text is detokenized (`wikitext_detokenizer`), BPE-tokenized, and scored left to right
    in windows of seq_length tokens.  With --overlapping-eval K a window starts K tokens after
    the previous one and scores only targets no earlier window scored, so every token but the
    first is predicted exactly once, with up to seq_length - K tokens of extra context.
        ppl          = exp(total loss / (bpe_tokens - 1))
        adjusted ppl = exp(total loss / (original_words - 1))      (word-level perplexity)
    with original_words = len(text.strip().split(" ")) of the word-level file.

LAMBADA (`lambada_test.jsonl`, one {"text": passage} per line):
    predict the end of the passage from the rest.  By default the target is the last BPE
    token; with --strict-lambada it is the whole last word (all of its BPE tokens).  A
    passage counts as correct when every target token is the argmax.
"""

import itertools
import json
import math
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.errors import DataError


def wikitext_detokenizer(text):
    """Undo WikiText's word-level tokenization (Megatron's rules, applied in this order)."""
    text = text.replace("s '", "s'")
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    for spaced, joined in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),
                           (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "),
                           (" ? ", "? "), (" , ", ", ")):
        text = text.replace(spaced, joined)
    text = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    text = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", text)
    text = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    for spaced, joined in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="),
                           (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"), (" \n", "\n"),
                           ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        text = text.replace(spaced, joined)
    return text


def lambada_detokenizer(text):
    """LAMBADA's passages use curly quotes; GPT-2's BPE saw straight ones."""
    return text.replace("\u201c", '"').replace("\u201d", '"').strip()


# ------------------------------------------------------------------------------ scoring

@dataclass
class WikitextResult:
    loss: float             # summed negative log likelihood (nats)
    num_tokenized_tokens: int
    num_original_tokens: int

    @property
    def avg_loss(self):
        return self.loss / (self.num_tokenized_tokens - 1)

    @property
    def ppl(self):
        return math.exp(min(20.0, self.avg_loss))

    @property
    def adjusted_ppl(self):
        return math.exp(min(20.0, self.loss / (self.num_original_tokens - 1)))


def _read_text(path, what):
    if not os.path.isfile(path):
        raise DataError(f"{what} file {path} "
                        f"{'is a directory' if os.path.isdir(path) else 'does not exist'}")
    try:
        with open(path, encoding="utf-8-sig") as f:  # (a BOM some editors write is no text)
            return f.read()
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text (byte {error.start}), so not a {what} "
                        "file") from None


def read_wikitext(path):
    text = _read_text(path, "WikiText")
    if len(text.strip().split(" ")) < 2:
        raise DataError(f"{path} holds fewer than two words; nothing to evaluate")
    first = text.lstrip().split("\n", 1)[0]
    if first.startswith("{") and _is_json_object(first):
        raise DataError(f"{path} holds JSON lines, LAMBADA's format, not WikiText's text; "
                        "evaluate it with --task LAMBADA")
    return text


def _is_json_object(line):
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def window_starts(num_tokens, seq_length, stride):
    """(start, first scored target, last scored target) of each window over num_tokens."""
    windows, scored_up_to, start = [], 0, 0
    while scored_up_to < num_tokens - 1:
        last_target = min(start + seq_length, num_tokens - 1)
        windows.append((start, scored_up_to + 1, last_target))
        scored_up_to = last_target
        start += stride
    return windows


def evaluate_wikitext(score_fn, tokenizer, text, seq_length, overlapping_eval=None,
                      batch_size=1, progress=None):
    """WikitextResult; score_fn(tokens [b, s]) -> log-probs [b, s, v] of the next token.
    `batch_size` windows per call; progress(windows done, windows) after each call."""
    stride = seq_length if overlapping_eval is None else overlapping_eval
    if not 0 < stride <= seq_length:
        raise DataError(f"--overlapping-eval {stride} must lie in [1, {seq_length}], the "
                        "window (--seq-length, else the model's positions): lower it (in "
                        "scripts/evaluate_zeroshot_gpt2.sh: OVERLAP)")
    num_original = len(text.strip().split(" "))
    tokens = tokenizer.tokenize(wikitext_detokenizer(text))
    if len(tokens) < 2:
        raise DataError("the text tokenizes to fewer than two tokens")
    windows = window_starts(len(tokens), seq_length, stride)
    # inputs, and the rows that predict the targets (row j predicts token start + j + 1)
    requests = ((tokens[start:last], range(first - 1 - start, last - start))
                for start, first, last in windows)
    total = 0.0
    for (start, first, last), log_probs in zip(
            windows, scored_rows(score_fn, requests, batch_size, len(windows), progress)):
        targets = torch.tensor(tokens[first:last + 1], dtype=torch.long)
        total -= log_probs.gather(1, targets[:, None]).double().sum().item()
    return WikitextResult(total, len(tokens), num_original)


def scored_rows(score_fn, requests, batch_size, count, progress=None):
    """For each (input ids, rows) of `requests`, in order: the log-probs [len(rows), v] of
    those rows. `batch_size` requests go through score_fn at once, right-padded to the
    longest: attention is causal, so a row never sees the padding after it."""
    if batch_size < 1:
        raise DataError(f"--batch-size must be at least 1, got {batch_size}")
    requests, done = iter(requests), 0
    while batch := list(itertools.islice(requests, batch_size)):
        inputs = torch.zeros(len(batch), max(len(ids) for ids, _ in batch), dtype=torch.long)
        for i, (ids, _) in enumerate(batch):
            inputs[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs = score_fn(inputs)
        for i, (_, rows) in enumerate(batch):
            yield log_probs[i, torch.as_tensor(rows, dtype=torch.long)]
        done += len(batch)
        if progress is not None:
            progress(done, count)


def read_lambada(path):
    texts = []
    for number, line in enumerate(_read_text(path, "LAMBADA").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError):
            text = None
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}:{number} is not a JSON object with a non-blank 'text' "
                            "string (lambada_test.jsonl format)")
        texts.append(text)
    if not texts:
        raise DataError(f"{path} holds no passages")
    return texts


def lambada_example(tokenizer, text, strict):
    """(context token ids, target token ids) for one passage."""
    text = lambada_detokenizer(text)
    if strict:
        last_word = text.split()[-1]
        context = tokenizer.tokenize(text[:text.rfind(last_word)].strip())
        return context, tokenizer.tokenize(" " + last_word)
    tokens = tokenizer.tokenize(text)
    return tokens[:-1], tokens[-1:]


def evaluate_lambada(score_fn, tokenizer, texts, seq_length, strict=False, batch_size=1,
                     progress=None):
    """(correct, total) passages whose target tokens are all predicted by argmax;
    `batch_size` passages per score_fn call, progress(passages done, passages) after each."""
    split = []
    for text in texts:
        context, targets = lambada_example(tokenizer, text, strict)
        if not context or not targets:
            raise DataError(f"LAMBADA passage too short to split into context and target: "
                            f"{text[:60]!r}")
        split.append((context, targets))
    needed = max((len(targets) for _, targets in split), default=0)
    if needed > seq_length:  # a window of seq_length inputs scores at most seq_length targets
        longest = next(i for i, (_, targets) in enumerate(split) if len(targets) == needed)
        raise DataError(f"the last word of LAMBADA passage {texts[longest][:60]!r} is {needed} "
                        f"tokens, more than --seq-length {seq_length} can score: give "
                        f"--seq-length {needed} or more (the longest target of the passages)")
    examples = []
    for context, targets in split:
        sequence = (context + targets)[-(seq_length + 1):]  # keep the end: it holds the target
        examples.append((sequence[:-1], targets))
    requests = ((inputs, range(len(inputs) - len(targets), len(inputs)))
                for inputs, targets in examples)
    correct = 0
    for (_, targets), log_probs in zip(
            examples, scored_rows(score_fn, requests, batch_size, len(examples), progress)):
        correct += log_probs.argmax(dim=-1).tolist() == targets
    return correct, len(texts)


def model_score_fn(model, vocab_size):
    """score_fn for a GPT2Model(parallel_output=False): log-softmax over the real vocab."""
    weight = model.language_model.embedding.word_embeddings.weight

    @torch.inference_mode()
    def score(tokens):
        tokens = tokens.to(weight.device)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        logits = model(tokens, positions.expand_as(tokens))[..., :vocab_size]
        return F.log_softmax(logits.float(), dim=-1).cpu()
    return score
