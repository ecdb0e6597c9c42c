"""Checkpoint compatibility with real DeepSpeed, run from its own venv (DeepSpeed's zero_to_fp32.py).

Skipped when the DeepSpeed venv (/work/dsvenv or $DEEPSPEED_VENV, made by
benchmarks/install_deepspeed_venv.sh) does not exist. The checks live in
benchmarks/deepspeed_compat.py, which also records them in docs/benchmarks.md.
"""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks")
sys.path.insert(0, BENCH)

import deepspeed_venv  # noqa: E402

pytestmark = pytest.mark.skipif(deepspeed_venv.deepspeed_python() is None,
                                reason="no DeepSpeed venv: bash benchmarks/install_deepspeed_venv.sh")


@pytest.fixture(scope="module")
def forward_rows(tmp_path_factory):
    import deepspeed_compat
    root = str(tmp_path_factory.mktemp("ours_to_deepspeed"))
    cases = [(s, p) for s in (1, 2, 3) for p in ("fp32", "bf16")]
    return {(s, p): (status, detail)
            for s, p, status, detail in deepspeed_compat.ours_to_deepspeed(root, cases)}


@pytest.mark.slow  # ~80 s: two spawned ranks train six checkpoints, DeepSpeed starts once
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deepspeed_zero_to_fp32_consolidates_our_dp2_checkpoints(forward_rows, stage, precision):
    """DeepSpeed's get_fp32_state_dict_from_zero_checkpoint == ours == the module's weights."""
    status, detail = forward_rows[(stage, precision)]
    if status == "skipped":
        pytest.skip(f"ZeRO stage {stage}: {detail}")
    assert status == "ok", detail


@pytest.mark.slow
def test_our_zero_to_fp32_reads_checkpoints_written_by_deepspeed(tmp_path):
    """Real DeepSpeed (DP=2, gloo, stages 1-3) saves; ours consolidates its live weights.
    Slow: each DeepSpeed start takes 30-60 s here."""
    import deepspeed_compat
    rows = deepspeed_compat.deepspeed_to_ours(str(tmp_path), (1, 2, 3))
    failures = [row for row in rows if row[2] != "ok"]
    assert not failures, failures


@pytest.mark.slow
def test_the_converter_reads_megatron_deepspeed_pipeline_checkpoints_written_by_deepspeed(
        tmp_path):
    """Real DeepSpeed's PipelineEngine (2 stages, a model named as Megatron-DeepSpeed's
    GPTModelPipe, ZeRO-1 in fp32 and bf16) saves; the converter reads each parameter's master
    and moments."""
    import deepspeed_compat
    rows = deepspeed_compat.pipeline_to_ours(str(tmp_path))
    failures = [row for row in rows if row[2] != "ok"]
    assert not failures and len(rows) == 2, rows
