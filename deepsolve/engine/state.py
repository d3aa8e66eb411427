"""State handling: a state is a tensor or a pytree of tensors, flattened to a list of leaves.

The engine works on flat leaf lists ``[t_0, .., t_{m-1}]``; :class:`Step` wraps the user's
``step(state, i)`` so that it maps leaves to leaves, and checks what every call returns
against the forward sweep's structure, shapes, dtypes and devices (a recomputed state with
other metadata raises instead of giving a wrong gradient). Pytrees are those of
``torch.utils._pytree`` (tuples, lists, dicts, registered dataclasses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Step", "is_diff", "flatten_state", "unflatten", "spec_str", "codec"]


def is_diff(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def flatten_state(state: Any) -> tuple[list[torch.Tensor], Any]:
    if isinstance(state, torch.Tensor):
        return [state], None
    leaves, spec = pytree.tree_flatten(state)
    if not leaves:
        raise TypeError("unroll: the state holds no tensors")
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"unroll: state leaf {k} is a {type(leaf).__name__}, not a tensor; every leaf "
                "of the state must be a tensor (keep constants in the step's closure)"
            )
    return leaves, spec


def unflatten(leaves: Sequence[torch.Tensor], spec: Any) -> Any:
    return leaves[0] if spec is None else pytree.tree_unflatten(list(leaves), spec)


def spec_str(spec: Any) -> str:
    """A one-line description of a pytree structure."""
    return " ".join(str(spec).split())


def codec(spec: Any) -> tuple[Callable[[Any], list | None], Callable[[list], Any]]:
    """``(flatten, unflatten)`` for states of structure ``spec``.

    ``flatten(obj)`` returns the leaves of ``obj`` in ``spec``'s order, or ``None`` when
    ``obj`` does not have that structure; a dict is flattened by key, so a step that builds
    its dict in another key order still gives each leaf its place. One-level dicts, tuples
    and lists (the usual states) take a few list operations; other pytrees go through
    ``torch.utils._pytree`` and a comparison of structures."""
    if spec is None:
        return (lambda obj: [obj]), (lambda leaves: leaves[0])
    kids = spec.children()
    flat = all(c.is_leaf() for c in kids)
    n = len(kids)
    if flat and spec.type is dict:
        keys = tuple(spec.context)

        def flatten_dict(obj: Any) -> list | None:
            if type(obj) is not dict or len(obj) != n:
                return None
            try:
                return [obj[k] for k in keys]
            except KeyError:
                return None

        return flatten_dict, (lambda leaves: dict(zip(keys, leaves, strict=True)))
    if flat and spec.type in (tuple, list):
        kind = spec.type

        def flatten_seq(obj: Any) -> list | None:
            return list(obj) if type(obj) is kind and len(obj) == n else None

        return flatten_seq, kind

    def flatten_tree(obj: Any) -> list | None:
        leaves, got = pytree.tree_flatten(obj)
        return leaves if got == spec else None

    return flatten_tree, (lambda leaves: pytree.tree_unflatten(list(leaves), spec))


def returns_output(res: Any, is_state: Callable[[Any], bool]) -> bool:
    """Whether a step's first result is ``(next_state, output)``: not a state itself, but a
    2-tuple whose first element is one (``is_state``)."""
    return not is_state(res) and isinstance(res, tuple) and len(res) == 2 and is_state(res[0])


class Step:
    """Calls the user's step on flat leaves and checks what comes back.

    The per-step check (:meth:`fast_check`: leaf count, shapes, dtypes, and the structure
    through the flattening) runs after every step evaluation, first or recomputed; every
    recorded step also checks devices (:meth:`check_leaves`) and its outputs
    (:meth:`check_outputs`), so that a recomputed state with other metadata than the
    forward sweep's raises instead of giving a wrong gradient."""

    def __init__(self, fn: Callable, spec: Any, proto: list[torch.Tensor],
                 has_output: bool | None):
        self.fn = fn
        self.spec = spec
        self.meta = [(t.shape, t.dtype, t.device) for t in proto]
        self.has_output = has_output
        self.out_spec: Any = None
        self.out_meta: list[tuple] = []
        self.n_out = 0
        self._flat, self._unflat = codec(spec)
        self._sd = [(t.shape, t.dtype) for t in proto]
        self._single = len(proto) == 1
        self._shape0, self._dtype0 = proto[0].shape, proto[0].dtype
        # with grad, states are restored and recomputed: the first call checks that the step
        # leaves its input as it was (a no-grad unroll is the plain loop, where it may not)
        self.check_input = torch.is_grad_enabled()

    def __call__(self, leaves: list[torch.Tensor], i: int):
        """Returns ``(next_leaves, output_leaves)``: the hot path; the structure is checked
        by the flattening, shapes and dtypes by :meth:`fast_check`."""
        spec = self.spec
        res = self.fn(leaves[0] if spec is None else self._unflat(leaves), i)
        if self.has_output:
            nxt, out = res
            out = [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
        else:
            nxt, out = res, ()
        if spec is None:
            return [nxt], out
        flat = self._flat(nxt)
        if flat is None:
            self.check(nxt, i)  # raises, naming the structures
        return flat, out

    def fast_check(self, leaves: list[torch.Tensor], i: int) -> None:
        """Per-step check of shapes and dtypes (a few hundred ns per leaf); on a mismatch the
        full check names what is wrong."""
        if self._single:
            t = leaves[0]
            try:
                if t.dtype is self._dtype0 and t.shape == self._shape0:
                    return
            except AttributeError:  # not a tensor
                pass
            self.check_leaves(leaves, i)
            return
        for t, (shape, dtype) in zip(leaves, self._sd, strict=True):  # count fixed by _flat
            try:
                if t.dtype is dtype and t.shape == shape:
                    continue
            except AttributeError:
                pass
            self.check_leaves(leaves, i)
            return

    def first(self, leaves: list[torch.Tensor], i: int):
        """The first call: decide whether the step returns outputs, and check structure; a
        step that modifies its input in place is refused here, at step ``i`` (the input's
        version counters), not in the reverse sweep after a whole forward sweep."""
        versions = _versions(leaves) if self.check_input else [None] * len(leaves)
        try:
            res = self.fn(self._unflat(leaves), i)
        except RuntimeError as e:
            if "in-place" not in str(e):
                raise
            raise RuntimeError(f"unroll: step {i} modified its input state in place, or "
                               "another tensor that requires grad "
                               f"({' '.join(str(e).split())[:200]}); a step must return new "
                               "tensors (x = x * a, not x *= a or x.mul_(a))") from None
        changed = [k for k, (t, v) in enumerate(zip(leaves, versions, strict=True))
                   if v is not None and _version(t) != v]
        if changed:
            raise RuntimeError(f"unroll: step {i} modified its input state in place (state "
                               f"leaf {changed[0]}); a step must return new tensors (x = x * a, "
                               "not x *= a or x.mul_(a)), since the unroll restores and "
                               "recomputes states from snapshots")
        if self.has_output is None:
            self.has_output = returns_output(res, self._matches)
        if self.has_output:
            if not (isinstance(res, tuple) and len(res) == 2):
                raise TypeError(f"unroll: step {i} must return (next_state, output) "
                                f"(has_output=True), got {type(res).__name__}")
            nxt, out = res
            out_leaves, self.out_spec = pytree.tree_flatten(out)
            for k, o in enumerate(out_leaves):
                if not isinstance(o, torch.Tensor):
                    raise TypeError(f"unroll: output leaf {k} of step {i} is a "
                                    f"{type(o).__name__}, not a tensor")
            self.n_out = len(out_leaves)
            self.out_meta = [(o.shape, o.dtype, o.device) for o in out_leaves]
        else:
            nxt, out_leaves = res, []
        nxt_leaves = self.check(nxt, i)
        return nxt_leaves, out_leaves

    def _matches(self, res: Any) -> bool:
        if self.spec is None:
            return isinstance(res, torch.Tensor)
        try:
            flat = self._flat(res)
        except Exception:  # pragma: no cover - exotic containers
            return False
        return flat is not None and all(isinstance(t, torch.Tensor) for t in flat)

    def check(self, nxt: Any, i: int) -> list[torch.Tensor]:
        """The full check of a returned state: structure, then :meth:`check_leaves`."""
        leaves: list[torch.Tensor] | None
        if self.spec is None:
            if not isinstance(nxt, torch.Tensor):
                raise TypeError(f"unroll: step {i} returned a {type(nxt).__name__}; expected "
                                "the next state (a tensor) or (next_state, output)")
            leaves = [nxt]
        else:
            leaves = self._flat(nxt)
            if leaves is None:
                raise self.structure_error(nxt, f"step {i} returned")
        return self.check_leaves(leaves, i)

    def structure_error(self, obj: Any, what: str, where: str = "") -> TypeError:
        """The one-line error for ``obj``, not of the state's structure: ``unroll: {what} a
        state of structure ...{where}, but the state has structure ...``."""
        try:
            got = spec_str(pytree.tree_structure(obj))
        except Exception:  # pragma: no cover - exotic containers
            got = type(obj).__name__
        want = spec_str(self.spec) if self.spec is not None else "a tensor"
        return TypeError(f"unroll: {what} a state of structure {got}{where}, but the state "
                         f"has structure {want}")

    def check_leaves(self, leaves: list[torch.Tensor], i: int) -> list[torch.Tensor]:
        """Every leaf a tensor of the forward sweep's shape, dtype and device."""
        _check_meta(leaves, self.meta, i, "state")
        return leaves

    def recorded_check(self, y: list[torch.Tensor], out: Sequence[torch.Tensor],
                       i: int) -> None:
        """The check of a recorded step: every state leaf's shape, dtype and device, and the
        outputs' (the detailed checks name what is wrong)."""
        for t, (shape, dtype, device) in zip(y, self.meta, strict=True):
            try:
                if t.dtype is dtype and t.shape == shape and t.device == device:
                    continue
            except AttributeError:
                pass
            self.check_leaves(y, i)
        if out or self.n_out:
            self.check_outputs(out, i)

    def check_outputs(self, out: Sequence[torch.Tensor], i: int) -> None:
        """The per-step outputs of a recorded step against those of step 0."""
        if len(out) != self.n_out:
            raise TypeError(f"unroll: step {i} returned {len(out)} output tensors, step 0 "
                            f"returned {self.n_out}; a step must return the same outputs at "
                            "every call")
        _check_meta(out, self.out_meta, i, "output")


def _check_meta(tensors: Sequence[Any], meta: Sequence[tuple], i: int, kind: str) -> None:
    """Each of ``tensors`` (step ``i``'s state leaves or outputs, ``kind``) a tensor of the
    ``(shape, dtype, device)`` in ``meta``; a one-line error naming the first that is not."""
    for k, (t, (shape, dtype, device)) in enumerate(zip(tensors, meta, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"unroll: step {i} returned a {type(t).__name__} for state leaf "
                            f"{k}; expected a tensor" if kind == "state" else
                            f"unroll: output leaf {k} of step {i} is a {type(t).__name__}, "
                            "not a tensor")
        if t.shape != shape or t.dtype != dtype or t.device != device:
            what = ("a state of the same shape, dtype and device at every call (recomputed "
                    "steps included)" if kind == "state" else
                    "outputs of the same shape, dtype and device at every call")
            raise ValueError(
                f"unroll: step {i} changed {kind} leaf {k} from {tuple(shape)} {dtype} on "
                f"{device} to {tuple(t.shape)} {t.dtype} on {t.device}; a step must return "
                + what)


def _version(t: Any) -> int | None:
    """A tensor's version counter (bumped by every in-place change); ``None`` where it has
    none (an inference tensor, not a tensor)."""
    try:
        return int(t._version)
    except (AttributeError, RuntimeError):
        return None


def _versions(leaves: Sequence[Any]) -> list[int | None]:
    return [_version(t) for t in leaves]
