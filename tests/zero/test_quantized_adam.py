"""zero.optim.quantized_adam (Adam8bit, Adam4bit): the codes' error bounds, AdamW semantics,
independence from how ZeRO cuts the parameters (DP=2 stages 0-3 vs one process), state bytes,
checkpoints."""

import copy
import os

import pytest
import torch

import zero
from tests.dist_utils import run_distributed
from tests.zero import engine_cases as cases
from zero.optim.quantized_adam import Adam4bit, Adam8bit, Piece, state_bytes_per_param
from zero.optim.quantized_adam_kernels import (EIGHT_BIT, FOUR_BIT, dequantize_signed,
                                               dequantize_signed4, dequantize_unsigned,
                                               dequantize_unsigned4, quantize_signed,
                                               quantize_signed4, quantize_unsigned,
                                               quantize_unsigned4)

BLOCK = EIGHT_BIT.block
WIDTHS = {"8bit": Adam8bit, "4bit": Adam4bit}

MIN_NUMEL = 64  # the tiny model's tensors are 512-1024 elements: quantise them
STEPS = 12


def _adam(width, params, **options):
    """Adam8bit or Adam4bit over `params`, quantising tensors of MIN_NUMEL elements up."""
    return WIDTHS[width](params, **{f"min_{width}_numel": MIN_NUMEL, **options})


def _blocks(block, seed=0):
    """64 blocks whose magnitudes span six decades, with exact zeros and a zero block."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, block, generator=generator) * torch.logspace(-6, 0, 64)[:, None]
    x[3, :10] = 0
    x[5] = 0
    return x


def test_8bit_round_trip_error_is_bounded_per_block_and_requantising_is_exact():
    x = _blocks(BLOCK)
    scale = x.abs().amax(1)
    codes = quantize_signed(x, scale)
    back = dequantize_signed(codes, scale)
    # the widest step of the signed code is the top one: 1 - (126/127)^2 of the absmax
    assert ((back - x).abs() <= 0.5 * (1 - (126 / 127) ** 2) * scale[:, None] + 1e-12).all()
    assert torch.equal(back.abs().amax(1), scale)  # each block's absmax is exact
    assert torch.equal(quantize_signed(back, back.abs().amax(1)), codes)
    assert (back[5] == 0).all() and (back[3, :10] == 0).all()
    v = x.square()
    v_scale = v.amax(1)
    v_codes = quantize_unsigned(v, v_scale)
    v_back = dequantize_unsigned(v_codes, v_scale)
    assert ((v_back - v).abs() <= 0.5 * (1 - (254 / 255) ** 4) * v_scale[:, None] + 1e-30).all()
    assert torch.equal(quantize_unsigned(v_back, v_back.amax(1)), v_codes)


def test_4bit_round_trip_error_is_bounded_per_block_and_requantising_is_exact():
    x = _blocks(FOUR_BIT.block)
    scale = x.abs().amax(1)
    codes = quantize_signed4(x, scale)
    assert codes.shape == (64, FOUR_BIT.block // 2) and codes.dtype == torch.uint8
    back = dequantize_signed4(codes, scale)
    # rounding happens on sqrt|x/s|: the largest error is at the top, half a code below 1
    assert ((back - x).abs() <= (1 - (6.5 / 7) ** 2) * scale[:, None] * 1.0001).all()
    assert torch.equal(back.abs().amax(1), scale)
    assert torch.equal(quantize_signed4(back, back.abs().amax(1)), codes)
    assert (back[5] == 0).all() and (back[3, :10] == 0).all()
    v = x.square()
    v_scale = v.amax(1)
    v_codes = quantize_unsigned4(v, v_scale)
    v_back = dequantize_unsigned4(v_codes, v_scale)
    # no code for zero: every value comes back at least 1/65536 of its block's max (zero
    # blocks stay zero), and never further away than half a code below the top
    assert ((v_back - v).abs() <= (1 - (15.5 / 16) ** 4) * v_scale[:, None] * 1.0001).all()
    assert (v_back >= v_scale[:, None] / 65536).all() and (v_back[5] == 0).all()
    assert torch.equal(quantize_unsigned4(v_back, v_back.amax(1)), v_codes)


def test_small_values_keep_relative_precision():
    """The non-linear code: a value at 1e-3 of its block's absmax keeps ~10% precision, where
    a linear int8 code would round it to zero."""
    x = torch.full((1, BLOCK), 1e-3)
    x[0, 0] = 1.0
    back = dequantize_signed(quantize_signed(x, x.abs().amax(1)), x.abs().amax(1))
    assert (back[0, 1:] - 1e-3).abs().max() < 0.15e-3


def _steps(width, compiled, steps=4):
    torch.manual_seed(0)
    weight = torch.randn(3 * BLOCK + 77, requires_grad=True)
    optimizer = _adam(width, [weight], lr=1e-2, weight_decay=0.1, compiled=compiled)
    for _ in range(steps):
        weight.grad = torch.randn(weight.numel()) * torch.logspace(-4, 0, weight.numel())
        optimizer.step()
    return weight.detach(), optimizer.adamw_state_dict()["state"][0]


@pytest.mark.parametrize("width", WIDTHS)
def test_the_compiled_step_is_the_eager_step(width):
    """The same formulas: equal up to the compiler's own choice of fused multiply-adds."""
    (compiled, compiled_state), (eager, eager_state) = _steps(width, True), _steps(width, False)
    assert torch.allclose(compiled, eager, rtol=0, atol=1e-6)
    assert torch.allclose(compiled_state["exp_avg"], eager_state["exp_avg"], rtol=1e-2,
                          atol=1e-7)


def test_without_a_compiler_the_step_runs_eagerly_with_one_note(monkeypatch, capsys):
    from zero.optim import quantized_adam_kernels as kernels

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\n(the rest of a long message)")
    monkeypatch.setattr(torch, "compile", no_compiler)
    assert kernels.compile_kernels(EIGHT_BIT) is kernels.row_kernels(EIGHT_BIT, compiled=False)
    out = capsys.readouterr().out
    assert out == (" note: the 8-bit Adam runs its step eagerly (torch.compile failed: no C++ "
                   "compiler found)\n")


def _tiny_model_pair():
    model = cases.make_model()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("width", WIDTHS)
def test_tracks_adamw_on_the_tiny_model(width):
    model, model_q = _tiny_model_pair()
    reference, _, _ = cases.train_reference(STEPS, model=model)
    quantized, _, _ = cases.train_reference(
        STEPS, model=model_q, optimizer=_adam(width, cases.param_groups(model_q), lr=cases.LR))
    assert quantized[-1] < quantized[0] - 0.05  # it learns
    assert max(abs(a - b) / a for a, b in zip(quantized, reference)) < 0.02


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("cuts", [[1000, 4333], [1, 127, 255, 256, 257, 4999], [4096],
                                  [128, 256, 512]])
def test_the_result_does_not_depend_on_where_the_tensor_is_cut(width, cuts):
    """One flat tensor holding two parameters, described whole and cut into pieces at odd
    places: bit-identical weights and states (blocks split by a cut take the MAX of their
    pieces' absmax; every operation rounds the same on any cut)."""
    n1, n2 = 5000, 9000
    whole = [Piece(0, n1, "a", 0, n1), Piece(n1, n2, "b", 0, n2)]
    pieces = []
    for piece in whole:
        bounds = [0] + [c for c in cuts if c < piece.length] + [piece.length]
        pieces += [Piece(piece.start + lo, hi - lo, piece.param, lo, piece.length)
                   for lo, hi in zip(bounds[:-1], bounds[1:])]
    torch.manual_seed(0)
    weights = [torch.randn(n1 + n2, requires_grad=True)]
    weights.append(weights[0].detach().clone().requires_grad_(True))
    optimizers = []
    for weight, description in zip(weights, (whole, pieces)):
        optimizer = _adam(width, [weight], lr=1e-2, weight_decay=0.1)
        optimizer.describe_partition({weight: description}, [description])
        optimizers.append(optimizer)
    for _ in range(5):
        grad = torch.randn(n1 + n2) * torch.logspace(-4, 0, n1 + n2)
        for weight, optimizer in zip(weights, optimizers):
            weight.grad = grad.clone()
            optimizer.step()
    assert torch.equal(weights[0], weights[1])
    states = [optimizer.adamw_state_dict()["state"][0] for optimizer in optimizers]
    assert torch.equal(states[0]["exp_avg"], states[1]["exp_avg"])
    assert torch.equal(states[0]["exp_avg_sq"], states[1]["exp_avg_sq"])
    saved = optimizers[0].state_dict()["state"][0]
    assert saved["exp_avg_codes"].numel() == n1 + n2  # codes, per element, not fp32 moments
    assert "exp_avg" not in saved


@pytest.mark.parametrize("width", WIDTHS)
def test_a_saved_state_loads_into_another_cut_and_goes_on_exactly(width):
    """The checkpoint format names its scale runs by parameter: saved from one tensor
    described whole, loaded into the same tensor cut into pieces elsewhere, the training goes
    on bit for bit as if never saved."""
    n1, n2 = 5000, 9000
    whole = [Piece(0, n1, "a", 0, n1), Piece(n1, n2, "b", 0, n2)]
    cut = [Piece(0, 1000, "a", 0, n1), Piece(1000, n1 - 1000, "a", 1000, n1),
           Piece(n1, 257, "b", 0, n2), Piece(n1 + 257, n2 - 257, "b", 257, n2)]
    torch.manual_seed(0)
    weight = torch.randn(n1 + n2, requires_grad=True)
    first = _adam(width, [weight], lr=1e-2, weight_decay=0.1)
    first.describe_partition({weight: whole}, [whole])
    grads = [torch.randn(n1 + n2) * torch.logspace(-4, 0, n1 + n2) for _ in range(6)]
    for grad in grads[:3]:
        weight.grad = grad.clone()
        first.step()
    resumed = weight.detach().clone().requires_grad_(True)
    second = _adam(width, [resumed], lr=1e-2, weight_decay=0.1)
    second.describe_partition({resumed: cut}, [cut])
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    for grad in grads[3:]:
        for w, optimizer in ((weight, first), (resumed, second)):
            w.grad = grad.clone()
            optimizer.step()
    assert torch.equal(weight, resumed)


def test_a_partition_of_padding_only_loads_a_checkpoint():
    """A rank whose partition of a tensor holds no parameter element (padding only) is
    described with no pieces: it saves nothing for it and loads whatever layout saved it."""
    torch.manual_seed(0)
    weight = torch.randn(5000, requires_grad=True)
    saving = Adam8bit([weight], lr=1e-2, min_8bit_numel=MIN_NUMEL)
    whole = [Piece(0, 5000, "a", 0, 5000)]
    saving.describe_partition({weight: whole}, [whole])
    weight.grad = torch.randn(5000)
    saving.step()
    padding = torch.zeros(64, requires_grad=True)
    loading = Adam8bit([padding], lr=1e-2, min_8bit_numel=MIN_NUMEL)
    loading.describe_partition({padding: []}, [[], whole])
    loading.load_state_dict(saving.state_dict())
    padding.grad = torch.zeros(64)
    loading.step()
    assert loading.state_dict()["state"][0]["quantized"]["small"] == []


@pytest.mark.parametrize("width", WIDTHS)
def test_saved_state_is_about_two_bytes_per_parameter(width):
    """Codes per element (4 bits: one per byte, so partitions can cut them anywhere) and
    their block scales; fp32 moments would be 8 bytes."""
    weight = torch.zeros(BLOCK * 4000, requires_grad=True)
    optimizer = WIDTHS[width]([weight])
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    entry = optimizer.state_dict()["state"][0]
    tensors = [entry["exp_avg_codes"], entry["exp_avg_sq_codes"]] + [
        run[2] for kind in ("scales", "small") for run in entry["quantized"][kind]]
    saved = sum(t.numel() * t.element_size() for t in tensors) / weight.numel()
    assert 2.0 < saved < 2.07


@pytest.mark.parametrize("width, most", [("8bit", 2.04), ("4bit", 1.07)])
def test_state_bytes_per_parameter(width, most):
    """8 bits: 1 + 1 + 2 x 4 / 256 = 2.03; 4 bits: 0.5 + 0.5 + 2 x 4 / 128 = 1.06."""
    weight = torch.zeros(BLOCK * 4000, requires_grad=True)
    optimizer = WIDTHS[width]([weight])
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    assert optimizer.state_bytes() / weight.numel() < most
    small = torch.zeros(100, requires_grad=True)  # below the threshold: fp32 moments
    optimizer = WIDTHS[width]([small])
    small.grad = torch.randn_like(small)
    optimizer.step()
    assert optimizer.state_bytes() >= 8 * small.numel()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_reported_bytes_per_param_are_what_the_state_holds(width):
    sizes = [BLOCK * 40 + 3, 5000, 100, 7]  # a partial last block; two fp32-state tensors
    weights = [torch.zeros(n, requires_grad=True) for n in sizes]
    optimizer = WIDTHS[width](weights)
    for weight in weights:
        weight.grad = torch.randn_like(weight)
    optimizer.step()
    step_counters = 4 * len(sizes)  # one fp32 scalar per tensor, left out of the formula
    measured = (optimizer.state_bytes() - step_counters) / sum(sizes)
    assert state_bytes_per_param(sizes, code=optimizer.code)[0] == pytest.approx(measured)


@pytest.mark.parametrize("width", WIDTHS)
def test_adamw_states_load_and_convert_back(width):
    model, model_q = _tiny_model_pair()
    adamw = torch.optim.AdamW(cases.param_groups(model), lr=cases.LR)
    cases.train_reference(3, model=model, optimizer=adamw)
    quantized = _adam(width, cases.param_groups(model_q), lr=cases.LR)
    model_q.load_state_dict(model.state_dict())
    quantized.load_state_dict(adamw.state_dict())  # AdamW -> quantised
    assert set(quantized.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    after_adamw, _, _ = cases.train_reference(3, start=3, model=model, optimizer=adamw)
    after_q, _, _ = cases.train_reference(3, start=3, model=model_q, optimizer=quantized)
    assert after_q[0] == after_adamw[0]  # same weights before the first step
    # the first step starts from AdamW's exact moments: the next loss is close
    assert abs(after_q[1] - after_adamw[1]) / after_adamw[1] < 1e-3
    assert max(abs(a - b) / a for a, b in zip(after_q, after_adamw)) < 0.02
    back = torch.optim.AdamW(cases.param_groups(model_q), lr=cases.LR)
    back.load_state_dict(quantized.adamw_state_dict())  # quantised -> AdamW
    assert torch.equal(back.state[next(model_q.parameters())]["exp_avg"].reshape(-1),
                       quantized.adamw_state_dict()["state"][0]["exp_avg"].reshape(-1))


@pytest.mark.parametrize("source, target", [("8bit", "8bit"), ("4bit", "4bit"),
                                            ("8bit", "4bit"), ("4bit", "8bit")])
def test_resume_from_a_state_dict_is_exact_and_widths_convert(source, target):
    model, model_q = _tiny_model_pair()
    first = _adam(source, cases.param_groups(model), lr=cases.LR)
    cases.train_reference(3, model=model, optimizer=first)
    model_q.load_state_dict(model.state_dict())
    second = _adam(target, cases.param_groups(model_q), lr=cases.LR)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    unbroken, _, _ = cases.train_reference(3, start=3, model=model, optimizer=first)
    resumed, _, _ = cases.train_reference(3, start=3, model=model_q, optimizer=second)
    if source == target:
        assert unbroken == resumed
    else:  # the other width quantises the same moments: close, not equal
        assert resumed[0] == unbroken[0]
        assert max(abs(a - b) / a for a, b in zip(resumed, unbroken)) < 0.02


# ----- through the engine: ZeRO stages 0-3, one and two processes -----

def _engine(stage, width="8bit", **options):
    model = cases.make_model()
    optimizer = _adam(width, cases.param_groups(model), lr=cases.LR)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer,
                                      config=cases.ds_config(stage, **options))
    return engine


CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


def _nvme(path, **extra):
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), **extra}}


def _variants(nvme_path, width):
    everything = {0: (0, {}), 1: (1, {}), 2: (2, {}), 3: (3, {}), "2+cpu": (2, CPU_OFFLOAD),
                  "3+cpu": (3, CPU_OFFLOAD), "2+nvme": (2, _nvme(nvme_path)),
                  "3+nvme": (3, dict(_nvme(nvme_path), sub_group_size=700))}
    if width == "4bit":  # the same machinery: the stages and the sub-groups that cut blocks
        return {name: everything[name] for name in (1, 2, 3, "3+nvme")}
    return everything


def _train_stages(rank, world_size, nvme_path, width):
    return {name: cases.train_steps(_engine(stage, width, **options), STEPS)
            for name, (stage, options) in _variants(nvme_path, width).items()}


@pytest.mark.parametrize("width", WIDTHS)
def test_zero_stages_at_dp2_give_the_single_process_losses(tmp_path, width):
    """Stages 0-3, and 2 and 3 with the optimizer offloaded to host memory and to NVMe (the
    masters swap; at stage 3 in sub-groups of 700 that cut blocks). The gradients
    differ in the last bit between layouts (their reduction order does), and a last-bit
    difference can move a moment across a code boundary (a code step is up to 1.6% of its
    block's absmax at 8 bits, 27% at 4), so the losses agree to a few 1e-4 (measured: up to
    1.0e-4 at 8 bits, 7.1e-5 at 4), not to fp32's 1e-6."""
    single = cases.train_steps(_engine(0, width), STEPS)
    results = run_distributed(_train_stages, 2, args=(str(tmp_path), width))
    for stage in _variants(tmp_path, width):
        assert results[0][stage] == results[1][stage]
        error = max(abs(a - b) / b for a, b in zip(results[0][stage], single))
        assert error < 3e-4, (stage, error)
    assert single[-1] < single[0] - 0.05


@pytest.mark.parametrize("stage, options, width",
                         [(2, {}, "8bit"), (3, {}, "8bit"), (2, CPU_OFFLOAD, "8bit"),
                          (3, "nvme", "8bit"), (2, {}, "4bit"), (3, "nvme", "4bit")],
                         ids=["stage2", "stage3", "stage2-offload", "stage3-nvme",
                              "stage2-4bit", "stage3-nvme-4bit"])
def test_engine_checkpoint_resumes_exactly(tmp_path, stage, options, width):
    if options == "nvme":
        (tmp_path / "swap").mkdir()
        options = dict(_nvme(tmp_path / "swap"), sub_group_size=700)
    first = _engine(stage, width, **options)
    cases.train_steps(first, 3)
    first.save_checkpoint(str(tmp_path))
    unbroken = cases.train_steps(first, 3, start=3)
    second = _engine(stage, width, **options)
    second.load_checkpoint(str(tmp_path))
    assert cases.train_steps(second, 3, start=3) == unbroken


@pytest.mark.parametrize("saved, resumed, width", [(2, 3, "8bit"), ("3+nvme", 1, "4bit")])
def test_a_checkpoint_resumes_exactly_at_the_other_family_of_stages(tmp_path, saved, resumed,
                                                                     width):
    """Stage 0-2 names a parameter's scale runs by (group, index), stage 3 by its name: the
    loader renames them, and the codes go on exactly."""
    def engine(variant):
        stage, _, nvme = str(variant).partition("+")
        options = dict(_nvme(tmp_path / "swap"), sub_group_size=700) if nvme else {}
        return _engine(int(stage), width, **options)
    (tmp_path / "swap").mkdir()
    first = engine(saved)
    cases.train_steps(first, 3)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    unbroken = cases.train_steps(first, 3, start=3)
    second = engine(resumed)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    assert cases.train_steps(second, 3, start=3) == unbroken


def test_nvme_offload_swaps_only_the_masters(tmp_path):
    """The 8-bit state stays in host memory; the swap folder holds one fp32 master file per
    key, no moment files."""
    engine = _engine(3, **_nvme(tmp_path, fast_init=False), sub_group_size=700)
    cases.train_steps(engine, 2)
    files = [name for _, _, names in os.walk(tmp_path) for name in names]
    assert files and all(name.endswith("_master.tensor.swp") for name in files)
    engine.destroy()


def _dp2_save_then_continue(rank, world_size, save_dir, width):
    engine = _engine(2, width)
    cases.train_steps(engine, 3)
    engine.save_checkpoint(save_dir)
    return cases.train_steps(engine, 3, start=3)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_dp2_checkpoint_resumes_at_dp1(tmp_path, width):
    """The checkpoint holds AdamW's per-element format: re-partitioned for one process, the
    quantised states are requantised on their blocks and training goes on as at DP=2."""
    continued = run_distributed(_dp2_save_then_continue, 2, args=(str(tmp_path), width))[0]
    single = _engine(2, width)
    single.load_checkpoint(str(tmp_path))
    resumed = cases.train_steps(single, 3, start=3)
    assert max(abs(a - b) / b for a, b in zip(resumed, continued)) < 1e-4


def _adamw_engine(stage):
    model = cases.make_model()
    optimizer = torch.optim.AdamW(cases.param_groups(model), lr=cases.LR)
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer,
                                      config=cases.ds_config(stage))
    return engine


def test_a_quantized_dp2_checkpoint_loads_into_adamw(tmp_path):
    """--optimizer adam after adam8bit: the engine decodes the codes with its own pieces and
    AdamW starts from the dequantised moments."""
    continued = run_distributed(_dp2_save_then_continue, 2, args=(str(tmp_path), "8bit"))[0]
    adamw = _adamw_engine(2)
    adamw.load_checkpoint(str(tmp_path))
    state = adamw.optimizer.optimizer.state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["exp_avg"].abs().sum() > 0
    resumed = cases.train_steps(adamw, 3, start=3)
    assert max(abs(a - b) / b for a, b in zip(resumed, continued)) < 0.02
