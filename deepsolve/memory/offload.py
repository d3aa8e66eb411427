"""Second storage levels for two-level schedules: host memory and a disk spill directory."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from ..executor import HostStorage

__all__ = ["HostStorage", "DiskStorage"]


class DiskStorage:
    """Snapshots as files in a private directory under ``spill_dir`` (for CPU-only machines
    whose RAM is the first level). The directory is removed by :meth:`close`, which the
    executor calls when the reverse sweep ends or fails; files are read back with
    ``torch.load(weights_only=True)``."""

    def __init__(self, spill_dir: str | os.PathLike | None = None):
        if spill_dir is not None:
            os.makedirs(spill_dir, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="deepsolve-spill-", dir=spill_dir)
        self.bytes_written = 0

    def _path(self, key) -> str:
        level, slot = key
        return os.path.join(self.dir, f"L{level}-S{slot}.pt")

    def put(self, key, tensors: list[torch.Tensor]) -> None:
        path = self._path(key)
        torch.save([t.detach().cpu() for t in tensors], path)
        self.bytes_written += os.path.getsize(path)

    def get(self, key, meta) -> list[torch.Tensor]:
        data = torch.load(self._path(key), weights_only=True)
        return [t.to(m[2]) for t, m in zip(data, meta, strict=True)]

    def drop(self, key) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __del__(self):  # last resort; close() is the contract
        try:
            self.close()
        except Exception:
            pass
