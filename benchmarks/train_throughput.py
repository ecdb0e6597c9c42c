"""Training throughput: our trainer vs a plain-PyTorch GPT vs Hugging Face GPT2LMHeadModel,
each eager and under torch.compile.

The same model (6 layers, hidden 384, 6 heads, seq 256, micro batch 8, vocab 8192, AdamW,
dropout 0 unless --dropout says otherwise, grad clipping 1.0) is trained for a few steps by
each, in fp32 and in bf16, in one run. Each trainer runs in its own process, as its users
run it (ours started as the launch scripts start training, so its engine keeps freed host
memory; one more row shows ours started without that), and the trainers take turns (round
robin) so drift of the machine hits all of them alike. Compiled means: ours with
--compile (each transformer layer; on a lone GPU the stack of layers), the peers with
torch.compile of the whole model, as their users would; compiling happens in the warm-up.
Prints a markdown table (tokens/s, MFU against the matmul peak measured in the same run,
ratios); with --write-docs it also rewrites its section of docs/benchmarks.md.

    python benchmarks/train_throughput.py [--quick] [--write-docs] [--dropout P]

--dropout P trains every model with dropout P on the embeddings, the attention probabilities
and the residual branches (GPT-2's and Megatron's default is 0.1) and writes its own section.

bf16 means: ours keeps bf16 parameters with fp32 master weights in the optimizer; the peers
use `torch.autocast(dtype=torch.bfloat16)` over fp32 parameters, their usual recipe.
"""

import argparse
import contextlib
import statistics
import time

from common import machine_description, markdown_table, update_docs_section

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {  # --size: the CPU default, and GPT-2 124M at its full context for a GPU
    "small": dict(num_layers=6, hidden_size=384, num_attention_heads=6, seq_length=256,
                  micro_batch=8, vocab_size=8192),
    "gpt2-124m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
                      micro_batch=8, vocab_size=50304),
}
DOCUMENTED_SIZE = {"cpu": "small", "cuda": "gpt2-124m"}  # each device's docs tables
PRECISIONS = ("fp32", "bf16")


def add_model_arguments(parser):
    """--device, --size and --precisions (this script's and step_profile.py's)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="small: 6 layers, hidden 384, seq 256, vocab 8192 (the CPU's); "
                             "gpt2-124m: 12 layers, hidden 768, seq 1024, vocab 50304 (the "
                             "GPU's). Default: the device's")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="comma-separated, of fp32 and bf16")


def model_arguments(parser, args):
    """(device, model sizes, precisions) from add_model_arguments' flags, checked; a docs
    table is only rewritten from its own configuration (the device's size, both precisions)."""
    precisions = args.precisions.split(",")
    if not set(precisions) <= set(PRECISIONS) or len(set(precisions)) != len(precisions):
        parser.error(f"--precisions takes fp32 and/or bf16, got {args.precisions!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    size = args.size or DOCUMENTED_SIZE[args.device]
    if args.write_docs and (size != DOCUMENTED_SIZE[args.device]
                            or set(precisions) != set(PRECISIONS)):
        parser.error(f"--write-docs rewrites the {args.device} table, which is of --size "
                     f"{DOCUMENTED_SIZE[args.device]} in both precisions; drop --write-docs or "
                     "--size/--precisions")
    return torch.device(args.device), SIZES[size], precisions


# ------------------------------------------------------------------ plain PyTorch reference

class _Block(nn.Module):
    def __init__(self, hidden, heads, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.fc_out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):                                          # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # [b, nh, s, hn]
        x = x + _dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), p)
        return x + _dropout(self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh")), p)


def _dropout(x, p):
    return F.dropout(x, p) if p else x  # dropout 0: the model as it was, no dropout call


class PlainGPT(nn.Module):
    def __init__(self, c, dropout=0.0):
        super().__init__()
        h, self.dropout = c["hidden_size"], dropout
        self.wte = nn.Embedding(c["vocab_size"], h)
        self.wpe = nn.Embedding(c["seq_length"], h)
        self.blocks = nn.ModuleList(_Block(h, c["num_attention_heads"], dropout)
                                    for _ in range(c["num_layers"]))
        self.ln_f = nn.LayerNorm(h)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        # GPT-2's initialisation, as ours and HF's use (torch's defaults give N(0, 1)
        # embeddings, whose tiny Adam updates end up as denormals that slow fp32 CPU math).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens, labels):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = _dropout(self.wte(tokens) + self.wpe(pos), self.dropout if self.training else 0.0)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)               # tied head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


# ------------------------------------------------------------------------------ runners

def _peer_step(c, device, model, autocast_dtype, compiled):
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    if compiled:
        model = torch.compile(model)
    data = torch.randint(0, c["vocab_size"], (c["micro_batch"], c["seq_length"] + 1),
                         device=device)
    tokens, labels = data[:, :-1], data[:, 1:]
    amp = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype
           else contextlib.nullcontext())

    def step():
        optimizer.zero_grad(set_to_none=True)
        with amp:
            loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step


def plain_runner(c, device, precision, compiled, dropout):
    torch.manual_seed(0)
    return _peer_step(c, device, PlainGPT(c, dropout),
                      torch.bfloat16 if precision == "bf16" else None, compiled)


def hf_runner(c, device, precision, compiled, dropout):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    config = GPT2Config(vocab_size=c["vocab_size"], n_positions=c["seq_length"],
                        n_embd=c["hidden_size"], n_layer=c["num_layers"],
                        n_head=c["num_attention_heads"], resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"  # the fused attention kernel, as ours uses
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, tokens, labels):
            # HF shifts labels itself; pass tokens as labels so the work matches ours.
            return self.inner(input_ids=tokens, labels=tokens).loss
    return _peer_step(c, device, Wrapped(), torch.bfloat16 if precision == "bf16" else None,
                      compiled)


def ours_runner(c, device, precision, compiled, dropout):
    """pretrain_gpt2.py's training step: the backend and zero engine pretrain() builds."""
    from common import trainer_backend
    from megatron.gpt2 import forward_step
    flags = ["--num-layers", c["num_layers"], "--hidden-size", c["hidden_size"],
             "--num-attention-heads", c["num_attention_heads"], "--seq-length", c["seq_length"],
             "--batch-size", c["micro_batch"], "--train-iters", 10 ** 6, "--lr", 1e-4,
             "--lr-decay-style", "constant", "--warmup-iters", 0, "--weight-decay", 0.01,
             "--clip-grad", 1.0, "--attention-dropout", dropout, "--hidden-dropout", dropout,
             "--threads", torch.get_num_threads(), "--device", device.type] \
        + (["--bf16"] if precision == "bf16" else []) + (["--compile"] if compiled else [])
    backend, _ = trainer_backend([str(f) for f in flags], c["vocab_size"])
    data = torch.randint(0, c["vocab_size"], (c["micro_batch"], c["seq_length"] + 1))
    batches = iter(lambda: {"text": data}, None)  # host tokens, as the data loader gives

    def step():
        backend.train_step(forward_step, batches, backend.ctx.config.training.global_batch_size)
    return step


DROPOUT_NOTE = (" (on the embeddings, the attention probabilities and the residual branches, "
                "for every trainer; ours compiled draws its masks inside the compiled graphs: "
                "hashed on the CPU, megatron/model/dropout.py)")

RUNNERS = {"ours": ours_runner, "plain PyTorch": plain_runner,
           "HF GPT2LMHeadModel": hf_runner}
OURS_COMPILED = "ours, compiled"
# Ours starts as scripts/launch_env.sh starts training (glibc's small-block cache off, which
# lets the engine keep freed buffers for reuse: zero/host_memory.py); the last row starts
# without it, so the engine leaves glibc's defaults: what keeping freed memory is worth.
GLIBC_DEFAULTS = "ours, compiled, glibc malloc defaults"


def trainer_rows(device, only_compiled=False):
    """{row label: (runner, compiled, started as the launch scripts start training)}; the
    glibc row only where host memory is the working memory (CPU)."""
    rows = {f"{name}, compiled" if compiled else name: (name, compiled, name == "ours")
            for name in RUNNERS for compiled in (False, True)
            if compiled or not only_compiled}
    if device.type == "cpu":
        rows[GLIBC_DEFAULTS] = ("ours", True, False)
    return rows


def _trainer_process(conn, runner, c, device, precision, compiled, dropout, threads):
    """One trainer in its own process: builds its step, says whether it could, then runs
    steps when told to, until told None."""
    from megatron.runtime.device import synchronize
    torch.set_num_threads(threads)
    device = torch.device(device)
    step = RUNNERS[runner](c, device, precision, compiled, dropout)
    conn.send(step is not None)
    for count in iter(conn.recv, None):
        times = []
        for _ in range(count):
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        conn.send(times)


def _start_trainer(context, args, launch_env):
    """The process (started as the launch scripts start training, or with this process's
    environment) and our end of its pipe."""
    from common import launch_scripts_environment
    conn, child_conn = context.Pipe()
    process = context.Process(target=_trainer_process, daemon=True, args=(child_conn, *args))
    with launch_scripts_environment() if launch_env else contextlib.nullcontext():
        process.start()
    child_conn.close()  # so a child that dies ends our recv() with EOFError
    return process, conn


def _receive(label, process, conn):
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"{label}: its process exited with code {process.exitcode} "
                           "(its traceback is above)") from None


def measure(c, device, precision, dropout, warmup, steps, rounds, threads, only_compiled):
    """{row label: median seconds per step}. Each trainer lives in its own process; they are
    built and warmed up (compiled) one at a time, then take turns, `steps` steps each per
    round, so drift of the machine hits all of them alike."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    trainers, times = {}, {}
    try:
        for label, (runner, compiled, launch_env) in trainer_rows(device, only_compiled).items():
            process, conn = _start_trainer(
                context, (runner, c, str(device), precision, compiled, dropout, threads),
                launch_env)
            trainers[label] = (process, conn)
            if not _receive(label, process, conn):  # a peer that is not installed
                continue
            conn.send(warmup)
            _receive(label, process, conn)
            times[label] = []
        for _ in range(rounds):
            for label in times:
                process, conn = trainers[label]
                conn.send(steps)
                times[label] += _receive(label, process, conn)
    finally:
        for process, conn in trainers.values():
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
    return {label: statistics.median(t) for label, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout of every model (embeddings, attention, residuals)")
    parser.add_argument("--only-compiled", action="store_true",
                        help="only the compiled trainers (a quicker comparison; not for docs)")
    add_model_arguments(parser)
    args = parser.parse_args()
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.write_docs and args.only_compiled:
        parser.error("--write-docs needs every trainer; drop --only-compiled")
    device, c, precisions = model_arguments(parser, args)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    warmup, steps, rounds = (1, 2, 1) if args.quick else (3, 5, 3)

    from megatron.runtime.device import measure_matmul_flops
    from megatron.model import GPTConfig, flops_per_token
    tokens_per_step = c["micro_batch"] * c["seq_length"]
    flops_per_step = flops_per_token(GPTConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"], vocab_size=c["vocab_size"],
        max_position_embeddings=c["seq_length"]), c["seq_length"]) * tokens_per_step

    rows = []
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        # A GPU needs large products to reach its peak; 2048 is already the CPU's. Measured
        # before and after the trainers, the higher kept: a process still exiting or a busy
        # neighbour lowers one measurement, and a low peak inflates every MFU.
        size = 2048 if device.type == "cpu" else 8192
        measure_matmul_flops(device, dtype, size=size, remeasure=True)
        seconds = measure(c, device, precision, args.dropout, warmup, steps, rounds, threads,
                          args.only_compiled)
        peak = measure_matmul_flops(device, dtype, size=size, remeasure=True)
        ours = tokens_per_step / seconds[OURS_COMPILED]
        for name, s in seconds.items():
            tps = tokens_per_step / s
            rows.append([precision, name, f"{s * 1000:.1f}", f"{tps:,.0f}",
                         f"{100 * flops_per_step / s / peak:.1f}%", f"{peak / 1e9:,.0f}",
                         "1.00" if name == OURS_COMPILED else f"{ours / tps:.2f}x"])
        print(f"{precision}: " + ", ".join(f"{n} {tokens_per_step / s:,.0f} tok/s"
                                          for n, s in seconds.items()), flush=True)
    table = markdown_table(["precision", "trainer", "ms/step", "tokens/s", "MFU",
                            "matmul peak (GFLOP/s)", "ours compiled / this"], rows)
    print("\n" + docs_body(args, c, device, warmup, steps * rounds, table))
    if args.write_docs and not args.quick:
        section = "train_throughput" + ("_dropout" if args.dropout else "") \
            + ("_cuda" if device.type == "cuda" else "")
        update_docs_section(section, docs_body(args, c, device, warmup, steps * rounds, table))


def docs_body(args, c, device, warmup, steps, table):
    flags = "".join(f" {flag}" for flag, given in (
        (f"--dropout {args.dropout:g}", args.dropout), ("--device cuda", device.type == "cuda"),
        (f"--size {args.size}", args.size is not None)) if given)
    with_dropout = f", dropout {args.dropout:g}" if args.dropout else ""
    on_gpu = ", GPU" if device.type == "cuda" else ""
    glibc = (" Ours starts as scripts/launch_env.sh starts training (glibc's small-block "
             "cache off), so its engine keeps freed host memory for reuse "
             "(zero/host_memory.py); the 'glibc malloc defaults' row is ours started "
             "without that." if device.type == "cpu" else
             " Ours is given host tokens each step, as its data loader gives them; the peers "
             "keep theirs on the GPU.")
    return (f"## Training throughput{with_dropout}{on_gpu} (`benchmarks/train_throughput.py"
            f"{flags}`)\n\n"
            f"Machine: {machine_description()}.\n\n"
            f"Model: {c['num_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} heads, seq {c['seq_length']}, micro batch "
            f"{c['micro_batch']}, vocab {c['vocab_size']}, AdamW, clip 1.0, dropout "
            f"{args.dropout:g}{DROPOUT_NOTE if args.dropout else ''}. "
            f"Median step time of {steps} steps per trainer after {warmup} warm-up "
            f"steps (compiling happens there), each trainer in its own process, taking "
            f"turns.{glibc} Compiled: ours with "
            f"--compile, the peers with torch.compile of the whole model. MFU = "
            f"(6N + 12·L·h·s)·tokens / time / the matmul peak measured in the same run "
            f"(before and after the trainers, the higher).\n\n"
            f"{table}\n")


if __name__ == "__main__":
    main()
