"""The package as users get it: one version everywhere, and a wheel that works outside the
checkout (installed into a fresh venv, the README's ``deepsolve.unroll`` example and
``python -m deepsolve --help`` run from a directory that is not the checkout)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import deepsolve

ROOT = Path(__file__).resolve().parents[1]


def _changelog_version() -> str:
    """The newest release heading of CHANGELOG.md (``## [X.Y.Z] - date``)."""
    m = re.search(r"^## \[(\d+\.\d+\.\d+[^\]]*)\] - \d{4}-\d{2}-\d{2}$",
                  (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert m, "CHANGELOG.md has no release heading '## [X.Y.Z] - YYYY-MM-DD'"
    return m.group(1)


def test_one_version_everywhere():
    cff = re.search(r"^version: (\S+)$", (ROOT / "CITATION.cff").read_text(), re.M)
    assert cff, "CITATION.cff has no version"
    versions = {"CHANGELOG.md": _changelog_version(), "deepsolve.__version__":
                deepsolve.__version__, "CITATION.cff": cff.group(1),
                "package metadata": importlib.metadata.version("deepsolve")}
    assert len(set(versions.values())) == 1, versions


def test_typed_package_marker():
    assert (Path(deepsolve.__file__).parent / "py.typed").exists()


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("build")  # the wheel and the sdist share the checkout's build/
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    pytest.importorskip("build", reason="install the [test] extra (python -m build)")
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                        "--outdir", str(dist), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = dist.glob("deepsolve-*.whl")
    assert deepsolve.__version__ in wheel.name
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    site = Path(site.stdout.strip())
    # the dependencies (torch is a 700 MB install) come from this environment's site-packages,
    # appended after the new venv's own: deepsolve itself can only come from the wheel, since
    # path entries added by a .pth file do not run that directory's .pth files (the editable
    # install's finder).
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install",
                        "--no-deps", "--no-index", "--quiet", str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"

    def run(*args: str) -> str:
        p = subprocess.run([str(py), *args], cwd=work, env=env, capture_output=True,
                           text=True, timeout=180)
        assert p.returncode == 0, f"{args} failed:\n{p.stdout}\n{p.stderr}"
        return p.stdout

    where = run("-c", "import deepsolve, pathlib; print(pathlib.Path(deepsolve.__file__)"
                ".resolve()); print(deepsolve.__version__); print((pathlib.Path("
                "deepsolve.__file__).parent / 'py.typed').exists())").split()
    assert Path(where[0]).is_relative_to(venv.resolve()), where   # not the checkout
    assert where[1:] == [deepsolve.__version__, "True"]
    out = run("-c", _readme_example())
    assert re.search(r"17976 recomputed steps for 5000 steps, 20 snapshots held", out), out
    assert "usage:" in run("-m", "deepsolve", "--help")
    console = subprocess.run([str(venv / "bin" / "deepsolve"), "--help"], cwd=work, env=env,
                             capture_output=True, text=True, timeout=120)
    assert console.returncode == 0 and "usage:" in console.stdout, console.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("build")
def test_sdist_carries_tests_problems_and_docs(tmp_path):
    pytest.importorskip("build", reason="install the [test] extra (python -m build)")
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation",
                        "--outdir", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import tarfile
    (sdist,) = tmp_path.glob("deepsolve-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for need in ("deepsolve/__init__.py", "deepsolve/py.typed", "pyproject.toml",
                 "CHANGELOG.md", "CITATION.cff", "LICENSE", "problems/navier_stokes.py",
                 "tests/test_unroll.py", "docs/unroll.md", "mkdocs.yml"):
        assert need in names, f"{need} missing from the sdist"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mypy_is_clean_on_the_package(tmp_path):
    """The annotations py.typed promises hold: mypy (config in pyproject.toml) finds nothing."""
    pytest.importorskip("mypy", reason="install the [test] extra")
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Success: no issues found" in r.stdout
