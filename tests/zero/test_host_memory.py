"""zero/host_memory.py: which glibc policy the engine picks, and that it does what it says.

Each case runs in a fresh interpreter: the policy is process-wide and set once."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = (10_000_000, 3_000_000, 10_000_000)  # fp32 elements: 40 MB blocks are above glibc's
# largest dynamic mmap threshold (32 MiB), so by default they are unmapped when freed
PAGE_FAULTS = textwrap.dedent(f"""
    import json, resource, sys, torch
    def faults_of_a_step_after_warmup(rounds=5):
        # what a training step does: allocate, fill and free the same sizes again and again
        for _ in range(rounds):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            tensors = [torch.empty(n).fill_(1.0) for n in {SIZES}]
            del tensors
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
""")
PAGES_PER_STEP = sum(SIZES) * 4 // 4096


def _run(body, **environ):
    """Run `body` in a fresh interpreter started with glibc's defaults plus `environ`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(environ)
    out = subprocess.run([sys.executable, "-c", PAGE_FAULTS + textwrap.dedent(body)],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc():
    import platform
    return platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _glibc(), reason="the policies tune glibc's malloc")
@pytest.mark.parametrize("policy", ["keep_freed_buffers", "return_freed_buffers_to_os"])
def test_kept_buffers_are_reused_without_page_faults_and_returned_ones_are_not(policy):
    faults = _run(f"""
        from zero import host_memory
        host_memory.{policy}()
        print(json.dumps(faults_of_a_step_after_warmup()))
    """)
    if policy == "keep_freed_buffers":
        assert faults < PAGES_PER_STEP // 10
    else:
        assert faults > PAGES_PER_STEP // 2


@pytest.mark.parametrize("cache_off", [True, False])
def test_training_on_cpu_keeps_freed_buffers_unless_offloading(tmp_path, cache_off):
    result = _run(f"""
        import zero
        from zero import host_memory
        policies = []
        for stage, offload in ((0, None), (1, None), (2, None), (3, None),
                               (3, {{"device": "cpu"}}),
                               (3, {{"device": "nvme", "nvme_path": "{tmp_path}"}})):
            host_memory._policy = None
            cfg = {{"train_micro_batch_size_per_gpu": 1,
                   "optimizer": {{"type": "Adam", "params": {{"lr": 1e-3}}}},
                   "zero_optimization": {{"stage": stage}}}}
            if offload:
                cfg["zero_optimization"]["offload_optimizer"] = offload
            zero.initialize(model=torch.nn.Linear(4, 4), config=cfg)
            policies.append(host_memory.policy())
        print(json.dumps(policies))
    """, **({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"} if cache_off else {}))
    # Stages 0-2 keep only when started with the small-block cache off (as the launch scripts
    # start training), stage 3 always; offload to host memory leaves glibc's defaults, NVMe
    # offload returns freed swap-ins.
    kept = "keep" if cache_off else None
    assert result == [kept, kept, kept, "keep", None, "return"]


@pytest.mark.skipif(not _glibc(), reason="the policies tune glibc's malloc")
def test_the_users_own_thresholds_win():
    """Started with glibc's default trim threshold named by the user: no keep policy, and a
    step maps its large tensors anew. Set in os.environ only after start, it is not the
    user's (glibc never read it), and the policy applies."""
    at_start = _run("""
        from zero import host_memory
        host_memory.keep_freed_buffers()
        print(json.dumps([host_memory.policy(), faults_of_a_step_after_warmup()]))
    """, MALLOC_TRIM_THRESHOLD_="131072")
    assert at_start[0] is None and at_start[1] > PAGES_PER_STEP // 2
    later = _run("""
        import os
        from zero import host_memory
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "131072"
        host_memory.keep_freed_buffers()
        print(json.dumps(host_memory.policy()))
    """)
    assert later == "keep"


@pytest.mark.parametrize("environ, own", [
    ({}, False), ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mmap_threshold=4096"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True), ({"MALLOC_TRIM_THRESHOLD_": "0"}, True),
    ({"MALLOC_ARENA_MAX": "2"}, False)])
def test_what_counts_as_the_users_own_thresholds(environ, own):
    from zero.host_memory import user_set_thresholds
    assert user_set_thresholds(environ) is own


@pytest.mark.parametrize("tunables, expected", [
    (None, "glibc.malloc.tcache_count=0"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"),
    ("glibc.malloc.tcache_count=3", "glibc.malloc.tcache_count=3"),  # a user's choice stays
])
def test_launch_environments_turn_glibcs_small_block_cache_off(tunables, expected):
    from zero.host_memory import small_block_cache_off, small_block_cache_off_environ
    environ = {} if tunables is None else {"GLIBC_TUNABLES": tunables}
    assert small_block_cache_off_environ(environ)["GLIBC_TUNABLES"] == expected
    assert small_block_cache_off(small_block_cache_off_environ(environ)) == (
        expected.endswith("tcache_count=0"))
    # the launch scripts source scripts/launch_env.sh, which must agree
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(environ)
    out = subprocess.run(["bash", "-c", "set -eu; source scripts/launch_env.sh; "
                          "echo \"$GLIBC_TUNABLES\""], capture_output=True, text=True,
                         cwd=REPO_ROOT, env=env, check=True)
    assert out.stdout.strip() == expected


@pytest.mark.skipif(not _glibc(), reason="the tunable is glibc's")
@pytest.mark.parametrize("tunables", ["", "glibc.malloc.tcache_count=0"])
def test_zero3_on_cpu_warns_when_started_with_glibcs_small_block_cache_on(tunables):
    script = textwrap.dedent("""
        import torch, zero
        for _ in range(2):  # a second engine in the same process does not repeat it
            zero.initialize(model=torch.nn.Linear(4, 4), config={
                "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    """)
    env = dict(os.environ, GLIBC_TUNABLES=tunables)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT, env=env)
    assert out.returncode == 0, out.stderr
    warnings = out.stderr.count("GLIBC_TUNABLES=glibc.malloc.tcache_count=0")
    assert warnings == (1 if tunables == "" else 0)
