"""Checkpoints saved by Megatron-LM itself (checkpoint versions 0, 1.0 and 3.0) and by
Megatron-DeepSpeed (with and without --deepspeed): made here from this trainer's own by their
renames (pickled argparse.Namespace arguments, NumPy RNG state, 'encoder', 'self_attention',
the older QKV row orders, DeepSpeed classes in the optimizer files), then converted and
trained from — the same weights as the original, bit for bit."""

import argparse
import contextlib
import enum
import os
import random
import shutil
import sys
import types

import numpy as np
import pytest
import torch

from megatron.convert.loaders import load_model_weights
from megatron.errors import CheckpointError
from tests.convert.conftest import load_tool
from tests.training.test_deepspeed import NO_DROPOUT, read_losses, run

tool = load_tool("convert_checkpoint")
HEADS = 4


class ModelType(enum.Enum):  # as Megatron defines them, pickled under Megatron's module
    encoder_or_decoder = 1
    encoder_and_decoder = 2


class PositionEmbeddingType(enum.Enum):  # Megatron-DeepSpeed's
    rotary = 1
    absolute = 2
    alibi = 3


@contextlib.contextmanager
def _megatron_enums(module="megatron.model.enums"):
    """torch.save pickles the two enums as Megatron's `module` would (a module of that name
    only while saving: loading must not need it)."""
    fake = types.ModuleType(module)
    for cls in (ModelType, PositionEmbeddingType):
        setattr(fake, cls.__name__, cls)
        cls.__module__ = module
    sys.modules[module] = fake
    try:
        yield
    finally:
        del sys.modules[module]
        for cls in (ModelType, PositionEmbeddingType):
            cls.__module__ = __name__


def _megatron_lm_file(state, version, extra_args=None):
    """Our checkpoint file's contents as Megatron-LM would have saved them."""
    args = dict(state["args"])
    args["tensor_model_parallel_size"] = args.pop("model_parallel_size")
    args.update(bias_gelu_fusion=True, position_embedding_type="learned_absolute",
                swiglu=False, params_dtype=torch.float32)
    args.update(extra_args or {})
    heads = HEADS // args["tensor_model_parallel_size"]
    language_model = dict(state["model"]["language_model"])
    layers = {key.replace(".attention.", ".self_attention."): _old_qkv(key, value, heads,
                                                                       version)
              for key, value in language_model.pop("transformer").items()}
    language_model["encoder" if version >= 2 else "transformer"] = layers
    saved = {"args": argparse.Namespace(**args), "iteration": state["iteration"],
             "model": {"language_model": language_model},
             "optimizer": {"optimizer": {"state": {}, "param_groups": []},
                           "fp32_from_fp16_params": [], "grad_scaler": None},
             "opt_param_scheduler": {"num_steps": state["iteration"]},
             "rng_state": [{"random_rng_state": random.getstate(),
                            "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state()}]}
    if version:
        saved["checkpoint_version"] = version
    return saved


def _old_qkv(key, tensor, heads, version):
    """Rows [heads, 3, head size] (2.0) in version 0's [3, heads, size] or 1.0's [heads,
    size, 3] order."""
    if not key.endswith((".query_key_value.weight", ".query_key_value.bias")) or version >= 2:
        return tensor
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    split = tensor.reshape(heads, 3, rows // (3 * heads), *rest)
    old = split.transpose(0, 1) if version == 0 else split.transpose(1, 2)
    return old.reshape(rows, *rest).contiguous()


def _as_megatron_lm(source, target, version, **extra_args):
    """A copy of the Megatron-layout checkpoint `source` in Megatron-LM's form."""
    shutil.copytree(source, target)
    extra_args = {"model_type": ModelType.encoder_or_decoder, **extra_args}
    for folder, _, files in os.walk(target):
        if "model_optim_rng.pt" in files:
            path = os.path.join(folder, "model_optim_rng.pt")
            state = torch.load(path, weights_only=True)
            with _megatron_enums():
                torch.save(_megatron_lm_file(state, version, extra_args), path)
    return target


def _edit_megatron_lm_file(mlm, change):
    """change(state) on the TP-rank-0 file of the Megatron-LM form `mlm` (iteration 2)."""
    path = mlm / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    with _megatron_enums():
        state = torch.load(path, weights_only=False)
        change(state)
        torch.save(state, path)


@pytest.fixture(scope="module")
def ours(corpus, tmp_path_factory):
    """This trainer's checkpoint after 2 iterations (TP 1), and the same at TP 2."""
    root = tmp_path_factory.mktemp("ours")
    assert run(corpus, root / "log", 2, *NO_DROPOUT, "--save", root / "tp1") == 0
    assert tool.main(["--load-dir", str(root / "tp1"), "--save-dir", str(root / "tp2"),
                      "--saver", "megatron", "--target-tensor-parallel-size", "2"]) == 0
    return root


@pytest.mark.parametrize("version, layout", [(3.0, "tp1"), (3.0, "tp2"), (1.0, "tp2"),
                                             (0, "tp2"), (0, "tp1")])
def test_a_megatron_lm_checkpoint_converts_to_the_same_weights(ours, tmp_path, version, layout):
    mlm = _as_megatron_lm(ours / layout, tmp_path / "mlm", version)
    expected = load_model_weights(str(ours / layout))
    found = load_model_weights(str(mlm))  # the format detected: Megatron's folders
    assert sorted(found.state_dict) == sorted(expected.state_dict)
    for name, tensor in expected.state_dict.items():
        assert torch.equal(found.state_dict[name], tensor), name
    assert found.iteration == expected.iteration
    assert tool.main(["--load-dir", str(mlm), "--save-dir", str(tmp_path / "hf"),
                      "--saver", "hf"]) == 0


def test_the_trainer_fine_tunes_from_it_as_from_the_original(corpus, ours, tmp_path):
    """--finetune from the Megatron-LM form at TP 1 and at TP 2 (merged to TP 1 as it
    loads): the same losses as from this trainer's own checkpoint of that layout."""
    for layout in ("tp1", "tp2"):
        assert run(corpus, tmp_path / f"expected_{layout}", 2, *NO_DROPOUT, "--load",
                   ours / layout, "--finetune") == 0
        mlm = _as_megatron_lm(ours / layout, tmp_path / f"mlm_{layout}", 3.0)
        assert run(corpus, tmp_path / layout, 2, *NO_DROPOUT, "--load", mlm,
                   "--finetune") == 0
        assert read_losses(tmp_path / layout) == read_losses(tmp_path / f"expected_{layout}")


def test_its_optimizer_state_is_not_read(corpus, ours, tmp_path, capsys):
    mlm = _as_megatron_lm(ours / "tp1", tmp_path / "mlm", 3.0)
    assert run(corpus, tmp_path / "resume", 4, *NO_DROPOUT, "--load", mlm) == 2
    out = capsys.readouterr()
    assert "was saved by Megatron-LM, whose optimizer and RNG states are in its own formats" \
        in out.out + out.err
    assert "add --no-load-optim --no-load-rng to continue at its iteration 2" in out.out + out.err
    assert run(corpus, tmp_path / "fresh", 4, *NO_DROPOUT, "--load", mlm, "--no-load-optim",
               "--no-load-rng") == 0
    assert sorted(read_losses(tmp_path / "fresh")) == [3, 4]


@pytest.mark.parametrize("extra_args, state_change, message", [
    ({"swiglu": True, "normalization": "RMSNorm"}, None,
     "for a model this trainer does not build: SwiGLU MLPs; a normalization other than "
     "LayerNorm"),
    ({"untie_embeddings_and_output_weights": True}, None,
     "an output layer untied from the word embeddings"),
    ({"position_embedding_type": PositionEmbeddingType.rotary}, None,
     "position embeddings other than learned absolute ones"),
    ({"model_type": ModelType.encoder_and_decoder}, None, "an encoder-decoder model"),
    ({"apply_layernorm_1p": True, "add_position_embedding": False}, None,
     "LayerNorm weights stored zero-centred (--apply-layernorm-1p); no position embeddings"),
    ({}, lambda s: s.update(model0=s["model"]), "interleaved pipeline chunks (model0"),
    ({}, lambda s: s.update(model={"decoder": {}}), "Megatron-core's layer names"),
])
def test_a_model_this_trainer_does_not_build_is_one_error(ours, tmp_path, extra_args,
                                                          state_change, message):
    mlm = _as_megatron_lm(ours / "tp1", tmp_path / "mlm", 3.0, **extra_args)
    if state_change is not None:
        _edit_megatron_lm_file(mlm, state_change)
    with pytest.raises(CheckpointError, match="was saved by Megatron-LM") as error:
        load_model_weights(str(mlm))
    assert message in str(error.value)


def test_other_pickled_classes_are_still_refused(ours, tmp_path):
    """Only Megatron-LM's argparse.Namespace and NumPy's RNG arrays are let through."""
    mlm = _as_megatron_lm(ours / "tp1", tmp_path / "mlm", 3.0)
    # a callable: what a malicious pickle would carry
    _edit_megatron_lm_file(mlm, lambda state: setattr(state["args"], "hook", shutil.rmtree))
    with pytest.raises(CheckpointError, match="Unsupported global: GLOBAL shutil.rmtree"):
        load_model_weights(str(mlm))


# where GPTModelPipe's list puts the layers with weights (the rest are functions, no files):
# Megatron-DeepSpeed's current list, and BigScience's fork (transposes around the layers)
_PIPELINE_NUMBERING = {"current": (1, 2, 1), "bigscience": (1, 3, 2)}


def _as_megatron_deepspeed_pipeline(source, target, numbering="current", stages=2):
    """This trainer's Megatron-layout checkpoint `source` as Megatron-DeepSpeed saves it with
    pipeline stages: model-states files per stage x TP rank with no module, and each layer's
    weights in layer_XX-model_TT-model_states.pt, numbered as `numbering` places them."""
    saved = next(folder for folder in source.iterdir() if folder.is_dir())  # iter_* or release
    shards = sorted(saved.iterdir())
    iteration = torch.load(shards[0] / "model_optim_rng.pt", weights_only=True)["iteration"]
    tag = target / f"global_step{iteration}"
    tag.mkdir(parents=True)
    (target / "latest").write_text(tag.name)
    embedding_at, first_layer_at, layernorm_after = _PIPELINE_NUMBERING[numbering]
    for tp_rank, shard in enumerate(shards):
        state = torch.load(shard / "model_optim_rng.pt", weights_only=True)
        language_model = state["model"]["language_model"]
        layers = language_model["transformer"]
        num_layers = state["args"]["num_layers"]

        def save_layer(index, weights):
            torch.save(weights, tag / f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt")

        save_layer(embedding_at, {f"{group}.{key}": value
                                  for group, entries in language_model["embedding"].items()
                                  for key, value in entries.items()})
        for number in range(num_layers):
            prefix = f"layers.{number}."
            save_layer(first_layer_at + number, {
                key[len(prefix):].replace("attention.", "self_attention.", 1): value
                for key, value in layers.items() if key.startswith(prefix)})
        # (the tied output layer's entry is a function of the embeddings' module: no file)
        save_layer(first_layer_at + num_layers - 1 + layernorm_after,
                   {key.split(".")[-1]: value for key, value in layers.items()
                    if key.startswith("final_layernorm.")})
        args = dict(state["args"])
        args["tensor_model_parallel_size"] = args.pop("model_parallel_size")
        args.update(pipeline_model_parallel_size=stages, num_experts=[1],
                    model_type=ModelType.encoder_or_decoder)
        for stage in range(stages):
            with _megatron_enums():
                torch.save({"module": None, "args": argparse.Namespace(**args),
                            "iteration": iteration, "global_steps": iteration,
                            "checkpoint_version": 3.0, "mp_world_size": stages * len(shards)},
                           tag / f"mp_rank_{stage * len(shards) + tp_rank:02d}"
                                 "_model_states.pt")
    return target


@pytest.mark.parametrize("layout, numbering", [("tp1", "current"), ("tp2", "current"),
                                               ("tp2", "bigscience")])
def test_a_megatron_deepspeed_pipeline_checkpoint_converts_from_its_layer_files(
        ours, tmp_path, layout, numbering):
    mds = _as_megatron_deepspeed_pipeline(ours / layout, tmp_path / "mds", numbering)
    expected, found = load_model_weights(str(ours / layout)), load_model_weights(str(mds))
    assert sorted(found.state_dict) == sorted(expected.state_dict)
    for name, tensor in expected.state_dict.items():
        assert torch.equal(found.state_dict[name], tensor), name
    assert found.iteration == expected.iteration
    assert tool.main(["--load-dir", str(mds), "--save-dir", str(tmp_path / "meg"),
                      "--saver", "megatron", "--target-pipeline-model-parallel-size", "2"]) == 0
    converted = load_model_weights(str(tmp_path / "meg"))
    for name, tensor in expected.state_dict.items():
        assert torch.equal(converted.state_dict[name], tensor), name


def _layer_files(mds, tp_rank=0):
    return sorted(mds.glob(f"global_step*/layer_*-model_{tp_rank:02d}-model_states.pt"))


def _remove_a_layer(mds):
    _layer_files(mds)[1].unlink()


def _add_a_key(mds):
    path = _layer_files(mds)[1]
    torch.save({**torch.load(path), "mlp.deepspeed_moe.gate.wg.weight": torch.zeros(2)}, path)


def _a_file_after_the_final_layernorm(mds):
    first = _layer_files(mds)[0]
    shutil.copy(first, first.parent / "layer_99-model_00-model_states.pt")


def _cut_positions_over_ranks(mds):
    """Megatron-DeepSpeed's --sequence-parallel: each TP rank holds a slice of positions."""
    path = _layer_files(mds)[0]
    state = torch.load(path)
    state["position_embeddings.local_embeddings.weight"] = \
        state.pop("position_embeddings.weight")[:16]
    torch.save(state, path)


def _remove_tp_rank_1(mds):
    for path in _layer_files(mds, 1):
        path.unlink()


@pytest.mark.parametrize("damage, message", [
    (_remove_a_layer, "holds 1 transformer layers for tensor-parallel rank 0, but its args say "
                      "--num-layers 2: layer files are missing"),
    (_add_a_key, "holds ['input_layernorm.bias', 'input_layernorm.weight', "
                 "'mlp.deepspeed_moe.gate.wg.weight'"),
    (_a_file_after_the_final_layernorm, "holds the embeddings where nothing (after the final "
                                        "LayerNorm) was expected"),
    (_cut_positions_over_ranks, "was saved with Megatron-DeepSpeed's --sequence-parallel, "
                                "which cuts the position embeddings over the tensor-parallel "
                                "ranks"),
    (_remove_tp_rank_1, "has no layer_*-model_01-model_states.pt files (tensor-parallel rank "
                        "1's weights): it is incomplete"),
])
def test_megatron_deepspeed_layer_files_that_do_not_make_one_model_are_one_error(
        ours, tmp_path, damage, message):
    mds = _as_megatron_deepspeed_pipeline(ours / "tp2", tmp_path / "mds")
    damage(mds)
    with pytest.raises(CheckpointError) as error:
        load_model_weights(str(mds))
    assert message in str(error.value)


def test_position_embeddings_cut_over_ranks_are_refused_in_the_megatron_layout(ours, tmp_path):
    """Megatron-DeepSpeed without --deepspeed, --sequence-parallel: the same one error."""
    mlm = _as_megatron_lm(ours / "tp1", tmp_path / "mlm", 3.0)

    def cut_positions(state):
        embedding = state["model"]["language_model"]["embedding"]
        embedding["position_embeddings"] = {
            "local_embeddings.weight": embedding["position_embeddings"]["weight"]}
    _edit_megatron_lm_file(mlm, cut_positions)
    with pytest.raises(CheckpointError, match="Megatron-DeepSpeed's --sequence-parallel, which "
                                              "cuts the position embeddings"):
        load_model_weights(str(mlm))
