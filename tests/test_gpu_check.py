"""benchmarks/gpu_check.py stays ready for a GPU: its CPU mode runs and keeps every budget."""

from __future__ import annotations

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _load():
    path = os.path.join(HERE, "..", "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_gpu_check_cpu_small(capsys):
    mod = _load()
    rc = mod.main(["--device", "cpu", "--small", "--steps", "60", "--fractions", "0.05", "0.5",
                   "1.0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("| ok |") == 3 and "FAIL" not in out


def test_gpu_check_refuses_missing_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert _load().main(["--device", "cuda"]) == 2
