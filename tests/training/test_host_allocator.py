"""megatron/runtime/host_allocator.py: a step's large CPU tensors reuse the last step's pages.

Each check runs in a fresh interpreter (the settings are process-wide) and counts the minor
page faults of the fifth of five identical "steps" that each allocate, fill and free three
64 MiB tensors: glibc's default maps them anew every step (one fault per 4 KiB page), with
the settings a step reuses the pages of the steps before.
"""

import os
import subprocess
import sys

import pytest

from megatron.runtime.host_allocator import user_configured_malloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import resource, torch
from megatron.runtime.host_allocator import reuse_freed_memory
applied = reuse_freed_memory() if {apply} else False
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 << 20)  # 64 MiB
    y = x * 2
    (y + x).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, [faults_of_one_step() for _ in range(5)][-1])
"""


def _probe(apply, **environ):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    env.update(environ)
    result = subprocess.run([sys.executable, "-c", PROBE.format(apply=apply)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    applied, faults = result.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_tensor_is_reused_instead_of_mapped_again():
    _, default_faults = _probe(apply=False)
    applied, faults = _probe(apply=True)
    assert default_faults > 30_000  # 3 x 16,384 pages of 4 KiB mapped again
    assert applied and faults < 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_users_own_malloc_settings_win():
    applied, faults = _probe(apply=True, MALLOC_MMAP_MAX_="65536")
    assert not applied and faults > 30_000


@pytest.mark.parametrize("environ, configured", [
    ({}, False), ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
    ({"MALLOC_ARENA_MAX_": "2"}, True), ({"MALLOC_CONF": "jemalloc's"}, False)])
def test_what_counts_as_the_users_own_settings(environ, configured):
    assert user_configured_malloc(environ) is configured
