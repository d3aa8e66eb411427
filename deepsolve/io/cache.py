"""A problem's expensive derived data (reference solutions, training sets), computed once.

A reference trajectory that a problem's ``build`` generates can take most of a run's setup
(minutes for a fine-grid solver), and ``build`` runs again for ``deepsolve plan``,
``deepsolve check`` and every ``--resume``. :func:`load_or_compute` keeps the arrays in an
HDF5 file whose name is a hash of everything they depend on::

    {directory}/{name}_{sha256(json(key))[:16]}.h5
        <array name>   one dataset per array
        attrs          the key (and any extra ``attrs``)

so an unchanged key reuses the file and any change of it computes (and stores) a new one.
A file is written to a temporary name and moved into place with ``os.replace``: a run
killed while writing never leaves a broken cache, and a file that cannot be read, or whose
stored key differs from the asked one, is computed again. Problem files use it through
:meth:`deepsolve.Context.cache`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["cache_path", "load_or_compute"]


def _key_json(key: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(key), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a cache key must be a dict of JSON values (numbers, strings, "
                         f"lists): {e}") from None


def cache_path(directory: str | os.PathLike, name: str, key: Mapping[str, Any]) -> str:
    """``{directory}/{name}_{hash of key}.h5`` (the hash: the first 16 hex digits of the
    SHA-256 of the key as sorted JSON)."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"cache name {name!r} must be a plain file name stem, e.g. 'reference'")
    digest = hashlib.sha256(_key_json(key).encode()).hexdigest()[:16]
    return os.path.join(os.fspath(directory), f"{name}_{digest}.h5")


def _numbers(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def _as_attr(v: Any) -> Any:
    """An HDF5 attribute: numbers and strings as they are, a list of numbers as an array,
    anything else (dicts, mixed lists, None) as JSON text."""
    if _numbers(v):
        return np.asarray(v)
    return json.dumps(v) if isinstance(v, (list, tuple, dict)) or v is None else v


def _matches(stored: Any, want: Any) -> bool:
    if isinstance(stored, bytes):
        stored = stored.decode()
    if _numbers(want):
        return isinstance(stored, np.ndarray) and stored.shape == (len(want),) and \
            bool(np.array_equal(stored, np.asarray(want)))
    if isinstance(want, (list, tuple, dict)) or want is None:
        return isinstance(stored, str) and stored == json.dumps(want)
    if isinstance(stored, np.ndarray) and stored.ndim > 0:
        return False
    try:
        return bool(stored == want)
    except (TypeError, ValueError):
        return False


def _read(path: str, key: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if not all(k in f.attrs and _matches(f.attrs[k], v) for k, v in key.items()):
                return None
            return {k: f[k][...] for k in f.keys() if isinstance(f[k], h5py.Dataset)}
    except (OSError, KeyError, ValueError):
        return None  # unreadable or incomplete: computed again


def load_or_compute(directory: str | os.PathLike, name: str, key: Mapping[str, Any],
                    compute: Callable[[], Mapping[str, Any]], *,
                    attrs: Mapping[str, Any] | None = None
                    ) -> tuple[dict[str, np.ndarray], str, bool]:
    """The arrays cached for ``key``, or ``compute()``'s, stored for next time.

    Args:
        directory: where cache files live (made if missing).
        name: the file name's stem (``"ns_train"``).
        key: everything the arrays depend on, as JSON values (numbers, strings, lists);
            include a version number to invalidate old files when the computation changes.
        compute: returns ``{array name: numpy array or torch tensor}``; called only on a miss.
        attrs: extra file attributes (descriptions, derived values), not part of the key.

    Returns ``(arrays as numpy arrays, path, computed)``; ``computed`` is False on a hit.
    """
    import h5py

    path = cache_path(directory, name, key)
    hit = _read(path, key) if os.path.exists(path) else None
    if hit is not None:
        return hit, path, False
    raw = compute()
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"cache {name!r}: compute() must return a non-empty dict of arrays, "
                         f"got {type(raw).__name__}")
    arrays = {str(k): (v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v))
              for k, v in raw.items()}
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f:
            for k, v in arrays.items():
                f.create_dataset(k, data=v)
            for k, v in {**(attrs or {}), **key}.items():
                f.attrs[k] = _as_attr(v)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return arrays, path, True
