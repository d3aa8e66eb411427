"""The C library's heap under a CPU budget: freed tensor memory goes back to the system."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Raise glibc's dynamic mmap threshold (free one mmapped 8 MiB block), then allocate twenty
# 4 MiB tensors pinned apart by 128 KiB ones and free them: with the thresholds fixed they were
# mmapped and RSS falls back; with glibc's defaults they came from the heap and stay resident.
CHILD = r"""
import json, sys
import torch
from deepsolve.memory.allocator import return_freed_memory
from deepsolve.memory.meter import process_status
fixed = return_freed_memory() if sys.argv[1] == "fix" else None
big = 4 * 2**20 // 8
first = torch.ones(2 * big, dtype=torch.float64)  # mmapped; freeing it makes glibc raise
del first  # its threshold to 8 MiB
held, pins = [], []
for _ in range(20):
    held.append(torch.ones(big, dtype=torch.float64))
    pins.append(torch.ones(32 * 1024))  # 128 KiB: from the heap's top, between the blocks
before = process_status("VmRSS:")
held.clear()
after = process_status("VmRSS:")
print(json.dumps({"fixed": fixed, "released": before - after}))
"""


def _run(mode: str, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k != "DEEPSOLVE_MALLOPT"}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         env=full, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_fixed_thresholds_return_freed_tensors_to_the_system():
    fixed = _run("fix")
    assert fixed["fixed"] is True
    assert fixed["released"] >= 70 * 2**20  # the twenty 4 MiB blocks went back
    default = _run("keep")  # glibc's dynamic threshold: the blocks came from the heap
    assert default["released"] < fixed["released"] / 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_opt_out_and_the_users_own_setting_are_respected():
    off = _run("fix", DEEPSOLVE_MALLOPT="0")
    assert off["fixed"] is False and off["released"] < 70 * 2**20
    own = _run("fix", MALLOC_MMAP_THRESHOLD_="65536")  # the environment already fixed it
    assert own["fixed"] is True and own["released"] >= 70 * 2**20
