"""deepsolve.io.cache and Context.cache: a problem's derived data computed once per key."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch

from deepsolve.io import cache_path, load_or_compute
from deepsolve.problem import Context


def _counting(values):
    calls = []

    def compute():
        calls.append(1)
        return values

    return compute, calls


def test_second_build_hits_the_cache(tmp_path):
    key = {"n": 8, "nu": 0.01, "version": 1, "times": [0.5, 1.0]}
    compute, calls = _counting({"u": torch.arange(8.0), "t": np.array([0.5, 1.0])})
    for _ in range(2):  # two builds of the same problem
        ctx = Context({"seed": 0, "cache_dir": str(tmp_path)}, torch.device("cpu"),
                      torch.float32)
        got = ctx.cache("reference", key, compute)
        torch.testing.assert_close(got["u"], torch.arange(8.0))
        np.testing.assert_array_equal(got["t"].numpy(), [0.5, 1.0])
    assert len(calls) == 1
    path, computed = ctx.cached["reference"]
    assert not computed and path == cache_path(tmp_path, "reference", key)
    assert os.path.basename(path).startswith("reference_") and path.endswith(".h5")
    with h5py.File(path) as f:  # the key is stored with the arrays
        assert f.attrs["n"] == 8 and list(f.attrs["times"]) == [0.5, 1.0]


def test_a_changed_key_or_a_damaged_file_computes_again(tmp_path):
    compute, calls = _counting({"u": np.ones(3)})
    _, p1, c1 = load_or_compute(tmp_path, "ref", {"n": 3}, compute)
    _, p2, c2 = load_or_compute(tmp_path, "ref", {"n": 4}, compute)
    assert c1 and c2 and p1 != p2 and len(calls) == 2
    with open(p1, "wb") as f:  # damaged (e.g. a disk that filled up in another program)
        f.write(b"not hdf5")
    _, p3, c3 = load_or_compute(tmp_path, "ref", {"n": 3}, compute)
    assert c3 and p3 == p1 and len(calls) == 3
    _, _, c4 = load_or_compute(tmp_path, "ref", {"n": 3}, compute)
    assert not c4 and len(calls) == 3
    # a file under the right name whose stored key differs (a hash collision, an edit)
    with h5py.File(p1, "r+") as f:
        f.attrs["n"] = 5
    _, _, c5 = load_or_compute(tmp_path, "ref", {"n": 3}, compute)
    assert c5 and len(calls) == 4


def test_a_failed_compute_leaves_no_file(tmp_path):
    def boom():
        raise FloatingPointError("the reference blew up")

    with pytest.raises(FloatingPointError):
        load_or_compute(tmp_path, "ref", {"n": 1}, boom)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key,name,match", [
    ({"f": object()}, "ref", "JSON values"),
    ({"n": 1}, "../ref", "plain file name"),
    ({"n": 1}, "", "plain file name"),
])
def test_bad_keys_and_names(tmp_path, key, name, match):
    with pytest.raises(ValueError, match=match):
        load_or_compute(tmp_path, name, key, lambda: {"u": np.ones(1)})
