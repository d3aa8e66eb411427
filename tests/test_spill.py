"""Spill folders of DiskStorage (two-level schedules): the pid in the name, removed on
SIGTERM, dead processes' folders removed at the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepsolve.memory import offload
from deepsolve.memory.offload import DiskStorage, remove_stale_spill_dirs

ROOT = Path(__file__).resolve().parents[1]


def test_spill_folder_names_carry_the_pid_and_host(tmp_path):
    disk = DiskStorage(tmp_path)
    try:
        name = os.path.basename(disk.dir)
        m = offload._NAME.match(name)
        assert m is not None, name
        assert int(m.group(1)) == os.getpid() and m.group(2) == offload._host()
        disk.put((1, 0), [torch.ones(3)])
        assert disk.get((1, 0), [(None, None, "cpu")])[0].tolist() == [1.0, 1.0, 1.0]
    finally:
        disk.close()
    assert os.listdir(tmp_path) == []


def test_dead_processes_folders_are_removed_at_the_next_start(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    host = offload._host()
    try:
        names = {
            "dead": f"deepsolve-spill-{dead.pid}-{host}-abcd1234",
            "live": f"deepsolve-spill-{live.pid}-{host}-abcd1234",
            "other_host": f"deepsolve-spill-{dead.pid}-elsewhere-abcd1234",
            "old_style": "deepsolve-spill-k2j4h5g6",
            "unrelated": "my-data",
        }
        for n in names.values():
            (tmp_path / n).mkdir()
            (tmp_path / n / "L1-S0.pt").write_bytes(b"x" * 100)
        (tmp_path / f"deepsolve-spill-{dead.pid}-{host}-file0000").write_bytes(b"a file")
        assert remove_stale_spill_dirs(tmp_path) == [str(tmp_path / names["dead"])]
        left = sorted(os.listdir(tmp_path))
        assert names["dead"] not in left and len(left) == 5
        (tmp_path / names["dead"]).mkdir()       # a DiskStorage cleans its parent first
        offload._SCANNED.discard(str(tmp_path))
        disk = DiskStorage(tmp_path)
        assert not (tmp_path / names["dead"]).exists()
        disk.close()
    finally:
        live.kill()
        live.wait()


HOLDER = """
import os, sys, time
from deepsolve.memory.offload import DiskStorage
import pytest
import torch
disk = DiskStorage(sys.argv[1])
disk.put((1, 0), [torch.zeros(1000)])
print(disk.dir, flush=True)
time.sleep(120)
"""


def test_sigterm_removes_open_spill_folders(tmp_path):
    """SIGTERM with its default action (a process killed by a scheduler) left the folder."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        spill = proc.stdout.readline().strip()
        assert spill and os.path.isdir(spill), proc.stderr.read()
        assert os.listdir(spill) == ["L1-S0.pt"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM         # still dies of SIGTERM
    assert not os.path.exists(spill)
    assert os.listdir(tmp_path) == []


def test_a_programs_own_sigterm_handler_is_left_alone(tmp_path):
    seen = []
    old = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        disk = DiskStorage(tmp_path)
        assert signal.getsignal(signal.SIGTERM) is not offload._on_sigterm
        disk.close()
    finally:
        signal.signal(signal.SIGTERM, old)
    disk = DiskStorage(tmp_path)
    try:
        assert signal.getsignal(signal.SIGTERM) is offload._on_sigterm
    finally:
        disk.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_open_spill_folders_are_removed_at_exit(tmp_path, monkeypatch):
    """The atexit callback that removes open spill folders: a Ctrl-C during it (a second one
    while the process exits) raised KeyboardInterrupt there, printed as "Exception ignored
    in atexit callback" with a traceback, and left the folders. Now the removal finishes,
    nothing escapes, and SIGINT's handler is put back."""
    import shutil
    import time

    folders = [tmp_path / f"deepsolve-spill-{i}" for i in range(3)]
    for f in folders:
        f.mkdir()
        (f / "slot").write_bytes(b"x")
    monkeypatch.setattr(offload, "_OPEN", {str(f) for f in folders})
    rmtree = shutil.rmtree

    def interrupted(path, *args, **kw):
        os.kill(os.getpid(), signal.SIGINT)   # a Ctrl-C while the folders are removed
        time.sleep(0.05)
        rmtree(path, *args, **kw)

    monkeypatch.setattr(offload.shutil, "rmtree", interrupted)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            offload._remove_open()
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C while the spill folders were removed escaped the callback")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert not any(f.exists() for f in folders)
    assert not offload._OPEN
