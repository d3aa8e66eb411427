"""The host allocator: exact live-byte counters on the CPU, and large blocks cached within a
budget's limit (the resident memory of large tensors never above the limit while the live
bytes are not), reused warm; tensors it hands out behave as any CPU tensor."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import deepsolve
from deepsolve.memory import hostalloc
from deepsolve.memory.allocator import cache_reserve

pytestmark = pytest.mark.skipif(not hostalloc.install(), reason=f"no host allocator: "
                                f"{hostalloc.why_inactive()}")

MiB = 2**20
PAGE = 4096


@pytest.fixture
def budget_mode():
    """A limit for the test, the previous one (none) restored after."""
    yield
    hostalloc.set_limit(None)


def test_counts_every_block_at_its_size_and_rounding():
    base = hostalloc.live()
    small = torch.empty(1000, dtype=torch.uint8)  # malloc's chunk for 1000 + 64 bytes
    assert hostalloc.live() - base == (1000 + 64 + 8 + 15) // 16 * 16
    big = torch.empty(MiB, dtype=torch.uint8)
    assert MiB <= hostalloc.live() - base - 1064 <= MiB + PAGE + 128
    del small, big
    assert hostalloc.live() == base


def test_tensors_it_hands_out_behave(budget_mode):
    hostalloc.set_limit(hostalloc.live() + 64 * MiB)
    for n in (0, 1, 3, 4096, 1 << 20):
        x = torch.arange(n, dtype=torch.float64)
        assert x.data_ptr() % 64 == 0 or n == 0  # PyTorch's alignment
        y = x.clone()
        y.resize_(2 * n)  # grows through the allocator
        assert torch.equal(y[:n], x)
        assert torch.equal(torch.from_numpy(x.numpy().copy()), x)
        del x, y
    a = torch.randn(300, 300, requires_grad=True)
    (a @ a).sum().backward()
    assert torch.allclose(a.grad, (torch.ones(300, 300) @ a.T + a.T @ torch.ones(300, 300)))


def test_large_blocks_are_cached_within_the_limit_and_reused(budget_mode):
    base = hostalloc.live()
    limit = base + 24 * MiB
    hostalloc.set_limit(limit)
    s0 = hostalloc.stats()
    blocks = [torch.empty(4 * MiB // 8, dtype=torch.float64) for _ in range(4)]  # 16 MiB
    del blocks  # kept warm: live + cached stay within the limit
    s1 = hostalloc.stats()
    assert s1["cached"] == 16 * MiB and s1["live"] + s1["cached"] <= limit
    again = [torch.empty(4 * MiB // 8, dtype=torch.float64) for _ in range(4)]
    s2 = hostalloc.stats()
    assert s2["hits"] - s1["hits"] == 4 and s2["misses"] == s1["misses"] and s2["cached"] == 0
    assert s1["misses"] - s0["misses"] == 4
    # a request the cache cannot serve evicts what is cached beyond the limit first
    del again
    other = torch.empty(12 * MiB // 8, dtype=torch.float64)
    s3 = hostalloc.stats()
    assert s3["evictions"] > s2["evictions"] and s3["live"] + s3["cached"] <= limit
    del other


def test_mapped_and_cached_never_exceed_the_limit_while_live_does_not(budget_mode):
    """A random sequence of sizes and frees under a limit: after every operation the live
    bytes plus the cached ones stay within the limit whenever the live bytes alone do."""
    gen = torch.Generator().manual_seed(0)
    base = hostalloc.live()
    limit = base + 20 * MiB
    hostalloc.set_limit(limit)
    held: list[torch.Tensor] = []
    for _ in range(300):
        if held and torch.rand(1, generator=gen).item() < 0.45:
            held.pop(int(torch.randint(len(held), (1,), generator=gen)))
        elif sum(t.numel() for t in held) < 12 * MiB:
            size = int(torch.randint(64 * 1024, 3 * MiB, (1,), generator=gen))
            held.append(torch.empty(size, dtype=torch.uint8))
        s = hostalloc.stats()
        if s["live"] <= limit:
            assert s["live"] + s["cached"] <= limit, s
    held.clear()
    hostalloc.set_limit(None)
    assert hostalloc.stats()["cached"] == 0


def test_counts_are_exact_under_threads(budget_mode):
    hostalloc.set_limit(hostalloc.live() + 64 * MiB)
    base = hostalloc.live()

    def work():
        for _ in range(200):
            a = torch.randn(1 << 14)
            b = torch.randn(1 << 16)
            (a.sum() + b.sum()).item()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hostalloc.live() == base


CHILD = r"""
import json, torch, deepsolve
from deepsolve.memory import hostalloc
from deepsolve.memory.allocator import cache_reserve
torch.manual_seed(0)
w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
x0 = torch.randn(1 << 15, dtype=torch.float64, requires_grad=True)
step = lambda x, i: x + 0.01 * torch.tanh(w * x)
for _ in range(2):  # two budgeted calls: the fallback is announced once
    st = deepsolve.UnrollStats()
    y = deepsolve.unroll(step, x0, 30, budget="12MiB", stats=st)
    g = torch.autograd.grad(y.sum(), [x0, w])
y = x0
for i in range(30):
    y = step(y, i)
r = torch.autograd.grad(y.sum(), [x0, w])
print(json.dumps(dict(active=hostalloc.active(), why=hostalloc.why_inactive(),
                      plan=st.extra["plan"].describe(),
                      err=max(((a - b).norm() / b.norm()).item() for a, b in zip(g, r)))))
"""


def run_child(env: dict[str, str]) -> tuple[dict, str]:
    """Two budgeted CPU unrolls in a fresh process (a crash is an exit code, not this
    process's death), every warning shown (``-W always``): what it reports, its stderr."""
    out = subprocess.run([sys.executable, "-W", "always", "-c", CHILD], capture_output=True,
                         text=True, env=dict(os.environ, **env), timeout=300)
    assert out.returncode == 0, f"exit code {out.returncode}: {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_without_a_compiler_deepsolve_falls_back_and_stays_exact(tmp_path):
    """No C++ compiler (``CXX`` names a program that fails) and an empty cache: the allocator
    is not installed, ``why_inactive`` says why in one line, and a budgeted unroll runs on
    glibc's fixed thresholds with exact gradients."""
    env = dict(os.environ, CXX="false", DEEPSOLVE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert not r["active"] and r["why"].startswith("compiling deepsolve's host allocator")
    assert "\n" not in r["why"] and r["err"] <= 1e-10
    assert os.listdir(tmp_path) == []  # no half-written library left behind


def test_build_is_atomic_and_cached(tmp_path):
    path = hostalloc.build(tmp_path / "lib.so")
    assert path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib.so", "lib.so.sha256"]
    digest, name = (tmp_path / "lib.so.sha256").read_text().split()  # sha256sum's format
    assert name == "lib.so" and digest == sha256(path)
    assert hostalloc.library_path().name.startswith(f"hostalloc-torch{torch.__version__}")


def test_build_fsyncs_the_library_its_checksum_and_the_directory(tmp_path, monkeypatch):
    """A crash after the rename must not leave a renamed but unwritten file: the library
    and its checksum are fsynced before their renames, the directory after them."""
    synced = []
    fsync = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    hostalloc.build(tmp_path / "lib.so")
    temps = [Path(p) for p in synced if Path(p).parent == tmp_path]
    assert len(temps) == 2 and all(p.name.startswith(".lib.so.") for p in temps)
    assert temps[1].name.endswith(".sha256.tmp") and synced[-1] == str(tmp_path)


def test_a_failed_build_names_the_compiler_and_its_last_line(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'compiling' >&2\necho 'fatal: out of cheese' >&2\nexit 3\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CXX", str(cc))
    with pytest.raises(RuntimeError) as e:
        hostalloc.build(tmp_path / "out" / "lib.so")
    assert str(e.value).startswith(f"compiling deepsolve's host allocator failed: {cc} exited "
                                   "with code 3: fatal: out of cheese; install")
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(RuntimeError, match=r"/bin/false exited with code 1 and no output; "):
        hostalloc.build(tmp_path / "out" / "lib.so")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler '.*no-such-c\+\+' found"):
        hostalloc.build(tmp_path / "out" / "lib.so")
    assert os.listdir(tmp_path / "out") == []  # nothing half-written left behind


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """This PyTorch's library and its checksum, built once for the module."""
    d = tmp_path_factory.mktemp("built")
    path = hostalloc.build(d / hostalloc.library_path().name)
    return path, path.with_name(path.name + ".sha256")


def _half(b: bytes) -> bytes:
    return b[:len(b) // 2]


def _flip(b: bytes) -> bytes:
    mid = len(b) // 2
    return b[:mid] + bytes([b[mid] ^ 0xFF]) + b[mid + 1:]


@pytest.mark.parametrize("damage", [_half, lambda b: b"", _flip, None, "record"],
                         ids=["truncated to half", "empty", "a byte flipped",
                              "no checksum", "checksum of another build"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(built, tmp_path, damage):
    """A cached library truncated (a full disk, a crash before its blocks reached the disk:
    loading it killed every budgeted run with SIGBUS), emptied (it silently disabled the
    allocator for good), with a byte changed, without its checksum (an older deepsolve's
    cache), or recorded with another build's checksum (a rename race): the next budgeted
    run rebuilds it, atomically, and runs with the allocator."""
    lib, record = built
    path = tmp_path / lib.name
    shutil.copy(lib, path)
    if damage is None:
        pass
    elif damage == "record":
        path.with_name(path.name + ".sha256").write_text(f"{'0' * 64}  {path.name}\n")
    else:
        shutil.copy(record, tmp_path)
        path.write_bytes(damage(lib.read_bytes()))
    r, _ = run_child({"DEEPSOLVE_CACHE_DIR": str(tmp_path)})
    assert r["active"] and r["err"] <= 1e-10, r
    assert path.read_bytes() == lib.read_bytes()  # rebuilt (the compiler is deterministic)
    assert path.with_name(path.name + ".sha256").read_text() == record.read_text()
    assert sorted(os.listdir(tmp_path)) == [path.name, path.name + ".sha256"]


def _libm() -> Path:
    """The C math library this process mapped: a shared object that loads anywhere."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        words = line.split()
        if len(words) >= 6 and re.search(r"/libm[.-][^/]*$", words[-1]):
            return Path(words[-1])
    pytest.skip("no libm mapped in this process")


def _record(path: Path) -> None:
    """Record the sha256 of whatever ``path`` holds as if a build had written it."""
    path.with_name(path.name + ".sha256").write_text(f"{sha256(path)}  {path.name}\n")


def test_another_shared_object_in_the_librarys_place_is_rebuilt(built, tmp_path):
    """A foreign shared object (libm) in the library's place, its checksum recorded: it
    loads but lacks the allocator's symbols (it killed every budgeted run with an
    AttributeError at ``ds_install``); it is rebuilt, loaded and run, without a warning."""
    lib, record = built
    path = tmp_path / lib.name
    shutil.copy(_libm(), path)
    _record(path)
    r, stderr = run_child({"DEEPSOLVE_CACHE_DIR": str(tmp_path)})
    assert r["active"] and r["err"] <= 1e-10, r
    assert path.read_bytes() == lib.read_bytes()
    assert path.with_name(path.name + ".sha256").read_text() == record.read_text()
    assert sorted(os.listdir(tmp_path)) == [path.name, path.name + ".sha256"]
    assert _announced(stderr) == [] and "Traceback" not in stderr


def test_a_library_whose_install_fails_is_rebuilt(built, tmp_path):
    """A library with every symbol of the allocator whose ``ds_install`` reports failure
    (a stub): damaged too, rebuilt, and the rebuilt one installs."""
    cxx = shutil.which(os.environ.get("CXX") or "c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    lib, _ = built
    src = tmp_path / "stub.cpp"
    src.write_text('#include <cstdint>\nextern "C" {\nint ds_install(void) { return 0; }\n'
                   "void ds_set_limit(int64_t) {}\nvoid ds_set_big_from(uint64_t) {}\n"
                   "void ds_reset_peak(void) {}\nvoid ds_stats(int64_t*) {}\n"
                   "int64_t ds_live(void) { return 0; }\nint64_t ds_peak(void) { return 0; }\n"
                   "int64_t ds_mapped(void) { return 0; }\n}\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / lib.name
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(path)], check=True)
    _record(path)
    r, stderr = run_child({"DEEPSOLVE_CACHE_DIR": str(cache)})
    assert r["active"] and r["err"] <= 1e-10, r
    assert path.read_bytes() == lib.read_bytes()
    assert sorted(os.listdir(cache)) == [path.name, path.name + ".sha256"]
    assert _announced(stderr) == []


def test_where_the_rebuild_is_no_allocator_either_the_fallback_is_one_line(tmp_path):
    """A foreign library cached, and a compiler that builds nothing better (it writes libm
    too): rebuilt once, then the fallback in one announced line; exit 0, no traceback."""
    log, libm = tmp_path / "compiler.log", _libm()
    cxx = tmp_path / "c++"
    cxx.write_text(f'#!/bin/sh\necho run >> {log}\nwhile [ $# -gt 0 ]; do\n'
                   f'  if [ "$1" = -o ]; then cp {libm} "$2"; fi\n  shift\ndone\n')
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / hostalloc.library_path().name
    shutil.copy(libm, path)
    _record(path)
    r, stderr = run_child({"DEEPSOLVE_CACHE_DIR": str(cache), "CXX": str(cxx)})
    assert not r["active"] and r["err"] <= 1e-10
    assert r["why"].startswith(f"loading deepsolve's host allocator failed: {cache}")
    assert "is not the allocator (it does not define ds_install" in r["why"]
    assert log.read_text().split() == ["run"]  # rebuilt once
    lines = _announced(stderr)
    assert len(lines) == 1 and "fix: check that CXX builds" in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr


def _stale(name: str) -> list[str]:
    """What a build of ``name`` killed before its renames leaves: its temporary files."""
    return [f".{name}.k1lled_0.tmp", f".{name}.abc_1234.sha256.tmp"]


def _kept(name: str) -> list[str]:
    """Names that are not the build's temporary files: never removed."""
    return [f".{name}.tmp", f".{name}.abcdefghi.tmp", ".other.so.abcdefgh.tmp", "notes.txt"]


def test_temporaries_of_a_killed_build_are_removed_by_the_next(built, tmp_path):
    """A build killed mid-compile leaves a 0-byte ``.<library>.XXXXXXXX.tmp`` (and, later in
    the build, its checksum's): the next process that builds removes them under the lock,
    and nothing else."""
    name = built[0].name
    for n in _stale(name) + _kept(name):
        (tmp_path / n).write_bytes(b"")
    r, _ = run_child({"DEEPSOLVE_CACHE_DIR": str(tmp_path)})
    assert r["active"] and r["err"] <= 1e-10, r
    assert sorted(os.listdir(tmp_path)) == sorted([name, name + ".sha256", *_kept(name)])


def _waiting_on_a_lock(pid: int) -> bool:
    return any(line.split()[1] == "->" and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines()
               if len(line.split()) > 5)


def test_a_live_builders_temporary_is_not_removed(built, tmp_path):
    """While another process holds the directory's lock (a builder compiling into its
    temporary file), a process that must build waits and removes nothing; once the lock is
    released without a library (the builder died), its temporary file is stale: removed."""
    import fcntl

    name = built[0].name
    live = tmp_path / _stale(name)[0]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        live.write_bytes(b"\x7fELF half")
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env=dict(os.environ, DEEPSOLVE_CACHE_DIR=str(tmp_path)))
        for _ in range(1200):
            if _waiting_on_a_lock(child.pid) or child.poll() is not None:
                break
            threading.Event().wait(0.05)
        assert _waiting_on_a_lock(child.pid), "the child never waited on the lock"
        assert live.read_bytes() == b"\x7fELF half"
    finally:
        os.close(fd)  # releases the lock
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["active"]
    assert sorted(os.listdir(tmp_path)) == [name, name + ".sha256"]


def test_build_removes_stale_temporaries_only_under_the_lock(tmp_path, monkeypatch):
    """``build`` removes earlier builds' temporary files; where the directory cannot be
    locked (a file system without locks) it cannot tell them from a live builder's: kept."""
    import fcntl

    for n in _stale("lib.so") + _kept("lib.so"):
        (tmp_path / n).write_bytes(b"")
    hostalloc.build(tmp_path / "lib.so")
    assert sorted(os.listdir(tmp_path)) == sorted(["lib.so", "lib.so.sha256",
                                                   *_kept("lib.so")])

    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    for n in _stale("lib.so"):
        (tmp_path / n).write_bytes(b"")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    hostalloc.build(tmp_path / "lib.so")
    assert sorted(os.listdir(tmp_path)) == sorted(["lib.so", "lib.so.sha256",
                                                   *_kept("lib.so"), *_stale("lib.so")])


def test_processes_that_build_at_once_all_get_the_allocator(tmp_path):
    """Three processes start with an empty cache: one builds (the others wait on the
    directory's lock and load what it built), none loads a half-written library."""
    env = dict(os.environ, DEEPSOLVE_CACHE_DIR=str(tmp_path))
    code = "from deepsolve.memory import hostalloc; print(hostalloc.install())"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e for _, e in outs]
    assert [o.strip() for o, _ in outs] == ["True"] * 3
    name = hostalloc.library_path().name
    assert sorted(os.listdir(tmp_path)) == [name, name + ".sha256"]


def _announced(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "HostAllocatorWarning" in line]


@pytest.mark.parametrize("setting", ["CXX=/bin/false", "CXX=no-such-c++",
                                     "cache dir under a file"])
def test_the_fallback_is_announced_once_with_its_reason_cost_and_fix(tmp_path, setting):
    """No compiler, or a cache directory that cannot be created (a path under a regular file:
    chmod does not stop root): one line over two budgeted unrolls, which says why, what it
    costs and what to do; the gradients exact as before."""
    if setting.startswith("CXX="):
        env = {"CXX": setting[4:], "DEEPSOLVE_CACHE_DIR": str(tmp_path)}
        why, fix = "compiling deepsolve's host allocator failed: ", "fix: install "
    else:
        (tmp_path / "file").write_text("")
        env = {"DEEPSOLVE_CACHE_DIR": str(tmp_path / "file" / "cache")}
        why, fix = "cache directory", "fix: set DEEPSOLVE_CACHE_DIR to a writable directory"
    r, stderr = run_child(env)
    assert not r["active"] and r["err"] <= 1e-10
    lines = _announced(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert why in lines[0] and fix in lines[0]
    assert "CPU budgets fall back to glibc's fixed thresholds, measured" in lines[0]
    assert "(docs/budget.md)" in lines[0] and "DEEPSOLVE_HOST_ALLOCATOR=0" in lines[0]


def test_no_announcement_when_turned_off_on_purpose(tmp_path):
    r, stderr = run_child({"DEEPSOLVE_HOST_ALLOCATOR": "0", "CXX": "/bin/false",
                           "DEEPSOLVE_CACHE_DIR": str(tmp_path)})
    assert not r["active"] and r["why"] == "DEEPSOLVE_HOST_ALLOCATOR=0"
    assert _announced(stderr) == [] and "host allocator" not in stderr


def test_a_budgeted_unroll_sets_the_limit_to_live_plus_budget(budget_mode):
    """A checkpointed plan: the cache limited to the live bytes at the call plus the budget
    less the reserve; a plan that keeps every step (plain backpropagation): no cache."""
    torch.manual_seed(0)
    x0 = torch.randn(1 << 16, dtype=torch.float64, requires_grad=True)
    step = lambda x, i: x * 0.99 + 0.01 * torch.sin(x)  # noqa: E731
    before = hostalloc.live()
    st = deepsolve.UnrollStats()
    y = deepsolve.unroll(step, x0, 60, budget="6MiB", stats=st)
    assert st.extra["plan"].kind != "store_all"
    s = hostalloc.stats()
    assert s["limit"] == before + 6 * MiB - cache_reserve(6 * MiB)
    assert s["live"] + s["cached"] <= s["limit"]
    y.sum().backward()
    assert torch.isfinite(x0.grad).all()
    st = deepsolve.UnrollStats()
    deepsolve.unroll(step, x0, 4, budget="64MiB", stats=st)
    assert st.extra["plan"].kind == "store_all" and hostalloc.stats()["limit"] == -1
