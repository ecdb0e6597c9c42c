"""Checkpoint compatibility with real DeepSpeed, both ways (its deepspeed/utils/zero_to_fp32.py).

    python benchmarks/deepspeed_compat.py [--write-docs]

ours -> DeepSpeed: zero's engine trains TinyNet at DP=2 (gloo) for ZeRO stages 1-3 in fp32 and
bf16 and saves; DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint` (in its venv)
consolidates each checkpoint. Its tensors must equal, bit for bit, what our zero_to_fp32 gives,
and the module's parameters (fp32) or their rounding (bf16: the masters round to the weights).
DeepSpeed -> ours: real DeepSpeed trains TinyNet at DP=2 for stages 1-3 and saves; our
`zero.get_fp32_state_dict_from_zero_checkpoint` must give its live weights exactly, and our
per-parameter reader (zero/checkpoint/whole_params.py, which converts Megatron-DeepSpeed's
checkpoints with their optimizer) each parameter's fp32 master and Adam moments as
DeepSpeed's optimizer held them (its safe_get_full_fp32_param / safe_get_full_optimizer_state).
DeepSpeed pipeline -> ours: its PipelineEngine trains a model named as Megatron-DeepSpeed's
GPTModelPipe on 2 stages (megatron_deepspeed_pipe_task.py); the converter's reading of each
stage's files, joined, must give the same per parameter. A stage our engine does not offer
yet is reported as skipped. Used by
tests/zero/test_deepspeed_compat.py and benchmarks/zero_memory_comm.py.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(1, os.path.dirname(BENCH_DIR))

import deepspeed_venv  # noqa: E402
from deepspeed_tasks import VOCAB, TinyNet  # noqa: E402

WORLD = 2
STEPS = 3


def _config(stage, precision):
    config = {"train_batch_size": 4 * WORLD, "train_micro_batch_size_per_gpu": 4,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 500}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _save_ours(rank, cases, root, init_file):
    """Spawned rank: train and save one checkpoint per (stage, precision) case."""
    import zero
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    for stage, precision in cases:
        out = os.path.join(root, f"ours_stage{stage}_{precision}")
        os.makedirs(out, exist_ok=True)
        torch.manual_seed(7)
        model = TinyNet()
        try:
            engine, *_ = zero.initialize(model=model, config=_config(stage, precision),
                                         optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
        except zero.ConfigError as e:  # a stage this engine does not have (yet)
            if rank == 0:
                with open(os.path.join(out, "unsupported"), "w") as f:
                    f.write(str(e))
            continue
        try:
            for step in range(STEPS):
                generator = torch.Generator().manual_seed(100 * step + rank)
                loss = engine(torch.randint(0, VOCAB, (4, 9), generator=generator))
                engine.backward(loss)
                engine.step()
            engine.save_checkpoint(os.path.join(out, "ckpt"))
        except Exception as e:  # noqa: BLE001 -- reported as this case's failure
            with open(os.path.join(out, f"error{rank}"), "w") as f:
                f.write(f"our engine failed: {type(e).__name__}: {e}")
            continue
        params = {n: p for n, p in engine.module.named_parameters()}
        gathered = getattr(zero, "GatheredParameters", None)
        context = gathered(list(params.values())) if stage == 3 and gathered else _null()
        with context:
            live = {n: p.detach().clone() for n, p in params.items()}
        if rank == 0:
            torch.save(live, os.path.join(out, "live.pt"))
            ours = zero.get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, "ckpt"))
            torch.save(ours, os.path.join(out, "ours_fp32.pt"))
        dist.barrier()
    dist.destroy_process_group()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _compare(result, reference, precision, what):
    """'' when every parameter of `reference` is in `result` and equal, else what differs."""
    problems = []
    for name, ref in reference.items():
        got = result.get(name)
        if got is None:
            problems.append(f"{name} missing")
            continue
        ok = torch.equal(got.to(ref.dtype), ref) if precision == "bf16" and \
            ref.dtype == torch.bfloat16 else torch.equal(got, ref.float())
        if not ok:
            problems.append(f"{name} differs from {what}")
    return "; ".join(problems[:3])


def ours_to_deepspeed(root, cases):
    """Rows (stage, precision, status, detail) for our checkpoints read by DeepSpeed."""
    os.makedirs(root, exist_ok=True)
    init_file = os.path.join(root, "rendezvous")
    mp.start_processes(_save_ours, args=(cases, root, init_file), nprocs=WORLD,
                       start_method="spawn")
    pairs, rows = [], []
    for stage, precision in cases:
        out = os.path.join(root, f"ours_stage{stage}_{precision}")
        if not any(os.path.exists(os.path.join(out, f)) for f in ("unsupported", "error0",
                                                                  "error1")):
            pairs += [os.path.join(out, "ckpt"), os.path.join(out, "ds_fp32.pt")]
    if pairs:
        deepspeed_venv.run_task("consolidate", *pairs)
    for stage, precision in cases:
        out = os.path.join(root, f"ours_stage{stage}_{precision}")
        if os.path.exists(os.path.join(out, "unsupported")):
            rows.append((stage, precision, "skipped", "stage not available in zero yet"))
            continue
        errors = [os.path.join(out, f"error{r}") for r in range(WORLD)]
        errors = [open(e).read() for e in errors if os.path.exists(e)]
        if errors:
            rows.append((stage, precision, "FAIL", errors[0][:300]))
            continue
        if os.path.exists(os.path.join(out, "ds_fp32.pt.error")):
            rows.append((stage, precision, "FAIL", open(out + "/ds_fp32.pt.error").read()))
            continue
        theirs = torch.load(os.path.join(out, "ds_fp32.pt"), weights_only=True)
        ours = torch.load(os.path.join(out, "ours_fp32.pt"), weights_only=True)
        live = torch.load(os.path.join(out, "live.pt"), weights_only=True)
        problem = _compare(theirs, ours, "fp32", "our zero_to_fp32") or \
            _compare(theirs, live, precision, "the module's parameters")
        if set(theirs) != set(ours):
            problem = problem or f"names differ: {sorted(set(theirs) ^ set(ours))}"
        rows.append((stage, precision, "FAIL" if problem else "ok",
                     problem or f"{len(theirs)} tensors equal"))
    return rows


def deepspeed_to_ours(root, stages):
    """Rows (stage, 'fp32', status, detail): DeepSpeed's checkpoints read by our consolidator."""
    from zero.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    rows = []
    for stage in stages:
        out = os.path.join(root, f"deepspeed_stage{stage}")
        os.makedirs(out, exist_ok=True)
        try:
            deepspeed_venv.launch_ranks(WORLD, ["deepspeed_tasks.py", "train_tiny", out, stage,
                                                STEPS])
        except RuntimeError as e:
            rows.append((stage, "fp32", "FAIL", f"DeepSpeed did not train: {str(e)[-300:]}"))
            continue
        live = torch.load(os.path.join(out, "live.pt"), weights_only=True)
        ours = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, "ckpt"))
        problem = _compare(ours, live, "fp32", "DeepSpeed's live weights") or \
            _optimizer_state_problem(os.path.join(out, "ckpt"), torch.load(
                os.path.join(out, "live_optimizer.pt"), weights_only=True))
        rows.append((stage, "fp32", "FAIL" if problem else "ok",
                     problem or f"{len(ours)} tensors equal; each parameter's master, "
                     "exp_avg and exp_avg_sq equal"))
    return rows


def _optimizer_state_problem(checkpoint_dir, live):
    """'' when zero's per-parameter reader (zero/checkpoint/whole_params.py, with DeepSpeed's
    pickled classes read as stand-ins) gives every parameter's fp32 master and Adam moments
    as DeepSpeed's optimizer held them, else what differs."""
    from zero.checkpoint.whole_params import open_saved
    from zero.checkpoint.zero_to_fp32 import load_zero_file
    with open(os.path.join(checkpoint_dir, "latest")) as f:
        tag_dir = os.path.join(checkpoint_dir, f.read().strip())
    saved = open_saved(tag_dir, 0, 1, load=load_zero_file)
    if not saved.names():
        return "no parameters read"
    problems = [] if saved.loss_scaler == {"dynamic": False, "cur_scale": 1} else \
        [f"its loss scaler read as {saved.loss_scaler!r}"]
    for name in saved.names():
        problems += _differences(saved, name, live[name], name)
    return "; ".join(problems[:3])


def _differences(saved, name, live, shown):
    """["<shown> <key> differs", ...] where the reader `saved` gives parameter `name`'s fp32
    master or Adam moments otherwise than DeepSpeed held them (`live`: its values by key)."""
    numel = live["master"].numel()
    found = {"master": saved.master(name, numel),
             **{key: saved.state(name, key, numel) for key in ("exp_avg", "exp_avg_sq")}}
    return [f"{shown} {key} differs" for key, value in found.items()
            if not torch.equal(value.reshape(-1), live[key].reshape(-1))]


def pipeline_to_ours(root, precisions=("fp32", "bf16")):
    """Rows (1, precision, status, detail): real DeepSpeed's PipelineEngine trains a model
    named as Megatron-DeepSpeed's GPTModelPipe on 2 stages at ZeRO-1 (bf16: its
    BF16_Optimizer) and saves; the converter's reading of its files (megatron/convert/
    joined_stages.py over each stage's ZeRO files, in the whole model's names from its layer
    files) must give each parameter's fp32 master and Adam moments as the stage's optimizer
    held them."""
    return [(1, precision, *_pipeline_problem(os.path.join(root, precision), precision))
            for precision in precisions]


def _pipeline_problem(root, precision):
    """(status, detail) of pipeline_to_ours for one precision."""
    from megatron.checkpointing.megatron_lm import (deepspeed_pipeline_parameter_name,
                                                    deepspeed_pipeline_prefixes)
    from megatron.convert.joined_stages import JoinedStages
    from zero.checkpoint.whole_params import open_saved
    from zero.checkpoint.zero_to_fp32 import load_zero_file
    os.makedirs(root, exist_ok=True)
    try:
        deepspeed_venv.launch_ranks(2, ["megatron_deepspeed_pipe_task.py", root, STEPS,
                                        precision])
    except RuntimeError as e:
        return "FAIL", f"DeepSpeed did not train: {str(e)[-300:]}"
    tag_dir = os.path.join(root, "ckpt", f"global_step{STEPS}")
    prefixes = deepspeed_pipeline_prefixes(tag_dir, 0, {"args": {"num_layers": 4}})
    joined = JoinedStages([open_saved(tag_dir, stage, 2, load=load_zero_file)
                           for stage in range(2)],
                          lambda name: deepspeed_pipeline_parameter_name(name, prefixes), tag_dir)
    problems, checked = [], set()
    for rank in range(2):
        live = torch.load(os.path.join(root, f"live_optimizer_rank{rank}.pt"), weights_only=True)
        for name, values in live.items():
            whole = deepspeed_pipeline_parameter_name(name, prefixes)
            if whole in checked:  # the tied embeddings' copy on the last stage
                continue
            checked.add(whole)
            problems += _differences(joined, whole, values, name)
    if sorted(checked) != sorted(joined.names()):
        problems.append(f"read {len(joined.names())} parameters, DeepSpeed held {len(checked)}")
    detail = "; ".join(problems[:3]) or (f"Megatron-DeepSpeed's pipeline layout (2 stages, "
                                         f"tied embeddings): {len(checked)} parameters' master, "
                                         "exp_avg and exp_avg_sq equal")
    return "FAIL" if problems else "ok", detail


def run_all(root, stages=(1, 2, 3), precisions=("fp32", "bf16"), reverse=True):
    """{'ours->deepspeed': rows, 'deepspeed->ours': rows, 'DeepSpeed pipeline->ours': rows};
    needs the DeepSpeed venv."""
    cases = [(s, p) for s in stages for p in precisions]
    result = {"ours->deepspeed": ours_to_deepspeed(os.path.join(root, "forward"), cases)}
    if reverse:
        result["deepspeed->ours"] = deepspeed_to_ours(os.path.join(root, "reverse"), stages)
        result["deepspeed pipeline->ours"] = pipeline_to_ours(os.path.join(root, "pipeline"))
    return result


def markdown(result, version):
    from common import markdown_table
    rows = [(direction, f"ZeRO-{stage}", precision, status, detail)
            for direction, items in result.items() for stage, precision, status, detail in items]
    return (f"Checkpoint compatibility with DeepSpeed {version} (DP={WORLD}, gloo, TinyNet with "
            "a tied head, 3 steps):\n\n" +
            markdown_table(["direction", "stage", "precision", "result", "detail"], rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite its section of docs/benchmarks.md (default: print only)")
    args = parser.parse_args()
    version = deepspeed_venv.deepspeed_version()
    if version is None:
        print("DeepSpeed venv not found: run benchmarks/install_deepspeed_venv.sh")
        return 1
    with tempfile.TemporaryDirectory() as root:
        text = markdown(run_all(root), version)
    print(text)
    if args.write_docs:
        from common import update_docs_section
        update_docs_section("deepspeed_compat", "## DeepSpeed checkpoint compatibility\n\n"
                            "`python benchmarks/deepspeed_compat.py`\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
