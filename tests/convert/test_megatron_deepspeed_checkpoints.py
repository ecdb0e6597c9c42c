"""Megatron-DeepSpeed --deepspeed checkpoints with ZeRO partitions (and pipeline stages): made
here from this trainer's own by Megatron-DeepSpeed's differences (pickled argparse.Namespace
arguments and Megatron-LM 2.x's names, in the module and in param_shapes; DeepSpeed's pickled
loss scaler and ZeRO stage enum in the optimizer files; its param groups' extra keys; its
learning-rate schedule counted in samples), then converted with their fp32 masters and Adam
moments and resumed: the same state as converting the original, the same losses as the run
that never stopped. (Its pipeline checkpoints' layer files: test_megatron_lm_checkpoints.py.)"""

import argparse
import contextlib
import enum
import os
import shutil
import sys
import types

import pytest
import torch

from megatron.checkpointing.megatron_lm import megatron_deepspeed_schedule
from megatron.checkpointing.state_dicts import to_flat_state_dict
from megatron.convert.deepspeed_source import read_deepspeed_checkpoint
from megatron.convert.loaders import load_model_weights
from megatron.errors import CheckpointError
from tests.convert.conftest import load_tool
from tests.convert.test_megatron_lm_checkpoints import (ModelType, PositionEmbeddingType,
                                                        _megatron_enums)
from tests.training.test_deepspeed import NO_DROPOUT, read_losses, run, stage_config

convert_tool = load_tool("convert_checkpoint")
merge_tool = load_tool("merge_mp_partitions")
GLOBAL_BATCH = 8
# --min-lr 0: where Megatron-LM 1.1.5's decay (the run saved here) and 2.x's (which the
# converted schedule keeps) agree
COMMON = [*NO_DROPOUT, "--global-batch-size", GLOBAL_BATCH, "--bf16", "--min-lr", 0]


class LossScaler:  # what DeepSpeed's ZeRO optimizer pickles as its "loss_scaler"
    def __init__(self, scale):
        self.cur_scale, self.dynamic = scale, False


class ZeroStageEnum(int, enum.Enum):  # what it pickles as its "zero_stage"
    optimizer_states = 1
    gradients = 2
    weights = 3


@contextlib.contextmanager
def _deepspeed_classes():
    """torch.save pickles the two classes under DeepSpeed's modules (only while saving)."""
    modules = {"deepspeed.runtime.fp16.loss_scaler": LossScaler,
               "deepspeed.runtime.zero.config": ZeroStageEnum}
    packages = {"deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16",
                "deepspeed.runtime.zero"}  # (pickle imports the parents too)
    for name in (*packages, *modules):
        sys.modules[name] = types.ModuleType(name)
    for name, cls in modules.items():
        setattr(sys.modules[name], cls.__name__, cls)
        cls.__module__ = name
    try:
        yield
    finally:
        for name in (*packages, *modules):
            del sys.modules[name]
        for cls in modules.values():
            cls.__module__ = __name__


def _their_name(name):
    return name.replace(".transformer.", ".encoder.").replace(".attention.", ".self_attention.")


def _their_schedule(ours):
    """AnnealingLR's state as Megatron-DeepSpeed's OptimizerParamScheduler saves it."""
    return {"max_lr": ours["start_lr"], "min_lr": ours["min_lr"],
            "lr_warmup_steps": ours["warmup_iter"] * GLOBAL_BATCH, "lr_warmup_tokens": None,
            "lr_decay_steps": ours["end_iter"] * GLOBAL_BATCH, "lr_decay_tokens": None,
            "num_steps": ours["num_iters"] * GLOBAL_BATCH, "num_tokens": 0,
            "lr_decay_style": ours["decay_style"], "start_wd": 0.01, "end_wd": 0.01,
            "wd_incr_style": "constant", "wd_incr_steps": 100}


def _nested(module):
    """A flat module state nested as Megatron-DeepSpeed's state_dict_for_save_checkpoint
    returns it (what it saves as DeepSpeed's `module`)."""
    nested = {"language_model": {"embedding": {}, "encoder": {}}}
    for name, tensor in module.items():
        part, rest = name.split(".", 2)[1:]
        if part == "embedding":
            table, key = rest.split(".")
            nested["language_model"]["embedding"].setdefault(table, {})[key] = tensor
        else:
            nested["language_model"]["encoder"][rest] = tensor
    return nested


def _as_megatron_deepspeed(source, target, schedule_change=None, optimizer="zero"):
    """A copy of this trainer's --deepspeed checkpoint (no pipeline stages) as Megatron-
    DeepSpeed saves it. `optimizer`: DeepSpeed's ZeRO optimizer over torch's Adam ("zero"),
    over apex's FusedAdam ("apex", the step counted in the param group), or DeepSpeed's
    BF16_Optimizer ("bf16_optimizer": no zero_stage, no loss scaler in its files)."""
    shutil.copytree(source, target)
    for folder, _, files in os.walk(target):
        for name in files:
            path = os.path.join(folder, name)
            if name.startswith("layer_"):  # (with pipeline stages: a layer's weights alone)
                continue
            if name.endswith("_model_states.pt"):
                state = torch.load(path, weights_only=True)
                args = dict(state["args"])
                args["tensor_model_parallel_size"] = args.pop("model_parallel_size")
                args["consumed_train_samples"] = state["iteration"] * GLOBAL_BATCH
                schedule = _their_schedule(state["lr_scheduler"])
                schedule.update(schedule_change or {})
                state.update(args=argparse.Namespace(
                    **args, num_experts=[1], normalization="layernorm",
                    model_type=ModelType.encoder_or_decoder,
                    position_embedding_type=PositionEmbeddingType.absolute),
                    checkpoint_version=3.0, lr_scheduler=schedule,
                    module=None if state["module"] is None else _nested(
                        {_their_name(key): value for key, value in state["module"].items()}),
                    param_shapes=[type(shapes)((_their_name(key), shape)
                                               for key, shape in shapes.items())
                                  for shapes in state["param_shapes"]])
                for key in ("random_rng_state", "np_rng_state", "torch_rng_state",
                            "rng_tracker_states", "train_state"):
                    state.pop(key, None)  # (its RNG states are in its own formats)
                with _megatron_enums("megatron.enums"):  # (BigScience's fork keeps them here)
                    torch.save(state, path)
            elif name.endswith("_optim_states.pt"):
                state = torch.load(path, weights_only=True)
                inner = state["optimizer_state_dict"]
                inner["loss_scaler"] = LossScaler(1.0)  # (bf16: a static scale of 1)
                inner["zero_stage"] = ZeroStageEnum(inner["zero_stage"])
                base = inner["base_optimizer_state"]
                for g, group in enumerate(base["param_groups"]):
                    group.update(name=("wd_no_scale_lr", "no_wd_no_scale_lr")[g], lr_mult=1.0,
                                 wd_mult=float(g == 0))
                    if optimizer == "apex":
                        group["step"] = int(base["state"][g].pop("step"))
                if optimizer == "bf16_optimizer":
                    del inner["zero_stage"], inner["loss_scaler"]
                with _deepspeed_classes():
                    torch.save(state, path)
    return target


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """A bf16 ZeRO stage 2 run: 6 iterations straight, and its checkpoint at iteration 3."""
    root = tmp_path_factory.mktemp("mds")
    common = [*COMMON, "--deepspeed", "--deepspeed_config", stage_config(root, 2, "bf16")]
    assert run(corpus, root / "straight", 6, *common) == 0
    assert run(corpus, root / "head", 6, *common, "--save", root / "ds",
               "--exit-interval", 3) == 0
    return root


def _converted_alike(ours, mds):
    """(the conversion of this trainer's checkpoint `ours`, that of its Megatron-DeepSpeed
    copy `mds`), asserting the same fp32 weights, optimizer state and masters."""
    expected, = read_deepspeed_checkpoint(str(ours), fp32_weights=True).shards
    found, = read_deepspeed_checkpoint(str(mds), fp32_weights=True).shards
    assert found["saved_by"] == "Megatron-DeepSpeed" and found["iteration"] == 3
    weights, got = to_flat_state_dict(expected["model"]), to_flat_state_dict(found["model"])
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    ours, theirs = expected["optimizer"], found["optimizer"]
    assert theirs["optimizer"]["param_groups"] == ours["optimizer"]["param_groups"]
    assert theirs["optimizer"]["state"].keys() == ours["optimizer"]["state"].keys()
    for index, entry in ours["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(theirs["optimizer"]["state"][index][key]),
                               torch.as_tensor(value)), (index, key)
    for group, group_found in zip(ours["fp32_from_fp16_params"],
                                  theirs["fp32_from_fp16_params"]):
        assert all(torch.equal(a, b) for a, b in zip(group, group_found))
    return expected, found


@pytest.mark.parametrize("optimizer", ["zero", "apex", "bf16_optimizer"])
def test_its_masters_and_adam_moments_convert_as_the_originals(saved, tmp_path, optimizer):
    mds = _as_megatron_deepspeed(saved / "ds", tmp_path / "mds", optimizer=optimizer)
    expected, found = _converted_alike(saved / "ds", mds)
    assert found["optimizer"]["grad_scaler"] == (
        None if optimizer == "bf16_optimizer" else {"dynamic": False, "cur_scale": 1.0})
    schedule = dict(found["lr_scheduler"])  # samples back to iterations, its formula kept
    assert schedule.pop("decay_formula") == "2.x"
    assert schedule == expected["lr_scheduler"]
    assert found["train_state"] == {"consumed_train_samples": 3 * GLOBAL_BATCH}
    assert "torch_rng_state" not in found


def test_it_resumes_where_the_run_stopped(corpus, saved, tmp_path, capsys):
    """Converted by merge_mp_partitions.py --deepspeed, it resumes with --no-load-rng (the
    tool's resume line says so; without it, one error says why) and continues the run's
    losses; weights-only conversion to Hugging Face's format works too."""
    mds = _as_megatron_deepspeed(saved / "ds", tmp_path / "mds")
    common = COMMON
    capsys.readouterr()
    assert run(corpus, tmp_path / "direct", 6, *common, "--deepspeed", "--deepspeed_config",
               stage_config(tmp_path, 2, "bf16"), "--load", mds) == 2
    assert "was saved by Megatron-DeepSpeed, whose DeepSpeed files this engine does not " \
           "resume: convert it with tools/merge_mp_partitions.py --deepspeed" in \
           capsys.readouterr().err
    assert merge_tool.main(["--deepspeed", "--load", str(mds), "--save",
                            str(tmp_path / "meg")]) == 0
    out = capsys.readouterr().out
    assert " optimizer state: converted" in out and "--no-load-rng ..." in out
    assert run(corpus, tmp_path / "no_flag", 6, *common, "--load", tmp_path / "meg") == 2
    assert "has no RNG state (converted from Megatron-DeepSpeed, whose RNG states are not " \
           "carried); load it with --no-load-rng" in capsys.readouterr().err
    assert run(corpus, tmp_path / "resumed", 6, *common, "--load", tmp_path / "meg",
               "--no-load-rng") == 0
    straight, resumed = read_losses(saved / "straight"), read_losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]  # with its optimizer and schedule: no fresh warm-up
    for iteration in (4, 5, 6):
        assert abs(resumed[iteration][0] - straight[iteration][0]) <= \
            3e-4 * abs(straight[iteration][0]), iteration
    assert convert_tool.main(["--load-dir", str(mds), "--save-dir", str(tmp_path / "hf"),
                              "--saver", "hf"]) == 0
    assert load_model_weights(str(tmp_path / "hf")).state_dict


def test_a_schedule_this_trainer_does_not_run_continues_only_when_overridden(corpus, saved,
                                                                           tmp_path, capsys):
    """A token-based decay: the optimizer state converts, the schedule does not; resuming
    asks for --override-lr-scheduler, which continues the command line's schedule."""
    mds = _as_megatron_deepspeed(saved / "ds", tmp_path / "mds",
                                 schedule_change={"lr_decay_tokens": 10 ** 6})
    capsys.readouterr()
    assert merge_tool.main(["--deepspeed", "--load", str(mds), "--save",
                            str(tmp_path / "meg")]) == 0
    assert "--override-lr-scheduler --no-load-rng ..." in capsys.readouterr().out
    common = [*COMMON, "--no-load-rng", "--load", tmp_path / "meg"]
    assert run(corpus, tmp_path / "asked", 5, *common) == 2
    assert "it was converted from Megatron-DeepSpeed, whose schedule (token-based lengths, " \
           "a weight decay that changes over the run, or a decay style this trainer lacks) " \
           "this trainer does not run. Pass --override-lr-scheduler" in capsys.readouterr().err
    assert run(corpus, tmp_path / "overridden", 5, *common, "--override-lr-scheduler") == 0
    out = capsys.readouterr().out
    assert "learning-rate schedule: the command line's, from iteration 3" in out
    assert sorted(read_losses(tmp_path / "overridden")) == [4, 5]


CONVERTED = {"start_lr": 1e-3, "min_lr": 1e-5, "warmup_iter": 1.5, "end_iter": 100,
             "num_iters": 7, "decay_style": "cosine", "decay_formula": "2.x",
             "fractional_warmup": True}


@pytest.mark.parametrize("change, expected", [
    ({}, CONVERTED),
    ({"lr_decay_style": "constant"}, {**CONVERTED, "decay_style": "constant"}),
    ({"lr_warmup_tokens": 500}, None),
    ({"lr_decay_style": "inverse-square-root"}, {**CONVERTED,
                                                  "decay_style": "inverse-square-root"}),
    ({"lr_decay_style": "WSD"}, None),  # (its length is in the args: the test below)
    ({"start_wd": 0.0, "end_wd": 0.1}, None),
])
def test_its_schedule_counts_samples(change, expected):
    """Megatron-LM 2.x and later step the schedule by the global batch: its lengths in
    iterations are the samples / the batch (a --lr-warmup-fraction's warmup may be a
    fraction of one); token-based lengths, a changing weight decay, decay styles AnnealingLR
    lacks: None."""
    theirs = {"max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 12.0,
              "lr_warmup_tokens": None, "lr_decay_steps": 800, "lr_decay_tokens": None,
              "num_steps": 56, "lr_decay_style": "cosine", "start_wd": 0.1, "end_wd": 0.1,
              **change}
    assert megatron_deepspeed_schedule(theirs, {"global_batch_size": 8}) == expected
    older = {"max_lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 12.0, "decay_steps": 800,
             "num_steps": 56, "decay_style": "cosine"}  # before its 2023 sync: 2.x's names
    assert megatron_deepspeed_schedule(older, {"global_batch_size": 8}) == CONVERTED
    assert megatron_deepspeed_schedule(older, {"global_batch_size": 8,
                                               "lr_decay_tokens": 10 ** 9}) is None
    old = {"start_lr": 1e-3, "warmup_iter": 2, "num_iters": 7, "end_iter": 10,
           "decay_style": "linear", "min_lr": 0.0}  # Megatron-LM 1.1.5's: as it is
    assert megatron_deepspeed_schedule(old, {"global_batch_size": 8}) == old


def test_its_schedule_under_a_batch_size_ramp_stays_in_samples():
    """A run with --rampup-batch-size (Megatron-DeepSpeed keeps its values as strings) had
    iterations of different sizes: the lengths stay samples, and AnnealingLR counting samples
    (a resume with --rampup-batch-size) continues at Megatron-LM 2.x's lr for sample 56."""
    import math

    import torch

    from megatron.training.learning_rates import AnnealingLR
    theirs = {"max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 12, "lr_decay_steps": 800,
              "num_steps": 56, "lr_decay_style": "cosine"}
    state = megatron_deepspeed_schedule(theirs, {"global_batch_size": 8,
                                                 "rampup_batch_size": ["2", "2", "100"]})
    assert state == {**CONVERTED, "warmup_iter": 12, "end_iter": 800, "num_iters": 56,
                     "step_unit": "samples"}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = AnnealingLR(optimizer, max_lr=1e-3, min_lr=1e-5, warmup_steps=12,
                           decay_steps=800, decay_style="cosine", unit="samples")
    schedule.load_state_dict(state)
    ratio = (56 - 12) / (800 - 12)
    assert schedule.get_lr() == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 *
                                              (1 + math.cos(math.pi * ratio)), rel=1e-12)


# ----- with pipeline stages -----

def _their_pipeline_name(name, first_layer):
    """This trainer's name of a stage's parameter as Megatron-DeepSpeed's PipelineModule names
    it: "tied_modules.embed." for the embeddings, "<place in GPTModelPipe's list>." for a layer
    (the current list: the embeddings at 1, the layers from 2, then the final LayerNorm)."""
    if name.startswith("language_model.embedding."):
        return "tied_modules.embed." + name[len("language_model.embedding."):]
    rest = name[len("language_model.transformer."):]
    if rest.startswith("final_layernorm."):
        return f"{2 + NUM_LAYERS}.{rest[len('final_layernorm.'):]}"
    _, number, key = rest.split(".", 2)
    if key.startswith("attention."):
        key = "self_" + key
    return f"{2 + first_layer + int(number)}.{key}"


NUM_LAYERS = 2  # (TINY's)


def _as_megatron_deepspeed_pipeline(source, target):
    """This trainer's --deepspeed checkpoint with 2 pipeline stages (DP 1) as Megatron-
    DeepSpeed saves it: its layer files numbered by GPTModelPipe's list, its ZeRO files'
    names the PipelineModule's, and the last stage also holding the tied embeddings (here
    zeros: the first stage's are the ones trained)."""
    _as_megatron_deepspeed(source, target)
    tag = next(p for p in target.iterdir() if p.is_dir())
    for path in sorted(tag.glob("layer_*-model_*-model_states.pt"), reverse=True):
        index, rest = path.name[len("layer_"):].split("-", 1)
        weights = {("self_" + key if key.startswith("attention.") else key): value
                   for key, value in torch.load(path, weights_only=True).items()}
        torch.save(weights, tag / f"layer_{int(index) + 1:02d}-{rest}")
        path.unlink()
    for stage in range(2):
        states_path = tag / f"mp_rank_{stage:02d}_model_states.pt"
        optim_path, = tag.glob(f"*zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt")
        with _megatron_enums("megatron.enums"), _deepspeed_classes():
            states = torch.load(states_path, weights_only=False)
            optim = torch.load(optim_path, weights_only=False)
        shapes = [type(group)((_their_pipeline_name(_our_name(key), stage * NUM_LAYERS // 2),
                               shape) for key, shape in group.items())
                  for group in states["param_shapes"]]
        if stage == 1:  # the tied embeddings' copy leads its first group
            tied = type(shapes[0])((f"tied_modules.embed.{table}.weight", shape)
                                   for table, shape in _embedding_shapes(tag).items())
            shapes[0] = type(shapes[0])([*tied.items(), *shapes[0].items()])
            extra = sum(torch.Size(shape).numel() for shape in tied.values())
            inner = optim["optimizer_state_dict"]
            flat = inner["single_partition_of_fp32_groups"]
            flat[0] = torch.cat([torch.zeros(extra), flat[0]])
            state = inner["base_optimizer_state"]["state"][0]
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.cat([torch.zeros(extra, dtype=state[key].dtype), state[key]])
        states["param_shapes"] = shapes
        with _megatron_enums("megatron.enums"), _deepspeed_classes():
            torch.save(states, states_path)
            torch.save(optim, optim_path)
    return target


def _our_name(their_name):
    return their_name.replace(".encoder.", ".transformer.").replace(".self_attention.",
                                                                     ".attention.")


def _embedding_shapes(tag):
    weights = torch.load(tag / "layer_01-model_00-model_states.pt", weights_only=True)
    return {"word_embeddings": weights["word_embeddings.weight"].shape,
            "position_embeddings": weights["position_embeddings.weight"].shape}


def test_a_pipeline_checkpoints_masters_and_moments_convert_as_the_originals(corpus, tmp_path):
    """Megatron-DeepSpeed's most common layout: each stage's ZeRO files, named by its
    PipelineModule, joined into one model's optimizer state (the tied embeddings from the
    first stage), equal to converting the original checkpoint (whose conversion continues
    the run's losses: tests/parallel/test_pipeline.py)."""
    from tests.dist_utils import run_distributed
    from tests.training.test_deepspeed import _train_dp, trainer_argv
    ds = ["--deepspeed", "--deepspeed_config", stage_config(tmp_path, 1, "bf16")]
    run_distributed(_train_dp, 2, args=(str(tmp_path), [trainer_argv(
        corpus, tmp_path / "log", 3, *COMMON, *ds, "--pipeline-model-parallel-size", 2,
        "--save", tmp_path / "ds")]))
    mds = _as_megatron_deepspeed_pipeline(tmp_path / "ds", tmp_path / "mds")
    _, found = _converted_alike(tmp_path / "ds", mds)
    assert found["args"]["pipeline_model_parallel_size"] == 1  # the stages joined
    incomplete = tmp_path / "incomplete"  # a copy that missed the last stage's ZeRO files
    shutil.copytree(mds, incomplete)
    for path in incomplete.glob("global_step3/*mp_rank_01_optim_states.pt"):
        path.unlink()
    with pytest.raises(CheckpointError, match=r"has ZeRO optimizer files for some pipeline "
                                              r"stages but none for model-parallel rank\(s\) "
                                              r"\[1\]"):
        read_deepspeed_checkpoint(str(incomplete))
    assert merge_tool.main(["--deepspeed", "--load", str(mds), "--save",
                            str(tmp_path / "meg")]) == 0


@pytest.mark.parametrize("warmup", [16, 0])
def test_its_inverse_square_root_and_wsd_continue_at_its_rates(warmup):
    """Later Megatron-LM counts samples: inverse-square-root's max(warmup, 1) / max(n, 1)
    in samples, a warmup of half a global batch or none at all; WSD's length from its args
    (--lr-wsd-decay-iters x the batch)."""
    import math

    import torch

    from megatron.training.learning_rates import AnnealingLR
    theirs = {"max_lr": 1.0, "min_lr": 0.0, "lr_warmup_steps": warmup, "lr_decay_steps": 3200,
              "num_steps": 96, "lr_decay_style": "inverse-square-root"}
    args = {"global_batch_size": 32}
    state = megatron_deepspeed_schedule(theirs, args)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = AnnealingLR(optimizer, max_lr=1.0, min_lr=0.0, warmup_steps=warmup / 32,
                           decay_steps=100, decay_style="inverse-square-root",
                           samples_per_step=32)
    schedule.load_state_dict(state)
    assert schedule.get_lr() == pytest.approx(math.sqrt(max(warmup, 1) / 96), rel=1e-12)
    wsd = megatron_deepspeed_schedule({**theirs, "lr_decay_style": "WSD"},
                                      {**args, "lr_wsd_decay_iters": 25,
                                       "lr_wsd_decay_style": "linear"})
    assert (wsd["wsd_decay_iter"], wsd["wsd_decay_style"]) == (25, "linear")
