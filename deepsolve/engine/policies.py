"""Recomputation policies inside a recorded step (selective activation checkpointing).

A *kept* tape (a ``Record`` range, every step of a store-all unroll) can be recorded under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with a policy that decides, op
by op, which outputs the tape keeps and which its backward recomputes from the step's input
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``). :class:`Recorder` records
a step so; :class:`CompiledPolicy` lets ``torch.compile``'s partitioner apply the policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from .replay import Autocast, autocast_state
from .state import Step

__all__ = ["POLICIES", "EXPENSIVE_OPS", "SAVE_FFT_OPS", "save_expensive", "save_fft",
           "policy_name", "policy_context", "CompiledPolicy", "Recorder"]


POLICIES = ("none", "save_expensive", "save_fft", "recompute_all")
"""Built-in recomputation policies for a kept recorded step:

* ``"none"`` — autograd keeps what each op saves (today's tape);
* ``"save_expensive"`` — keep the outputs of matrix products, convolutions, FFTs, attention
  and dense factorisations/solves (:data:`EXPENSIVE_OPS`); recompute everything else
  (pointwise ops, reductions, copies) from the step's input in its backward;
* ``"save_fft"`` — keep the outputs of FFTs only (:data:`SAVE_FFT_OPS`): for spectral
  solvers with a small network inside, whose convolutions are cheaper to recompute than to
  keep;
* ``"recompute_all"`` — keep only the step's input; its backward re-runs the whole step
  (``torch.utils.checkpoint`` of one step).

Wrap any of them in :class:`CompiledPolicy` to apply it inside ``torch.compile`` (no per-op
dispatch at run time).
"""


def _ops(*names: str) -> frozenset:
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:  # ops missing from this torch build are skipped
            found.add(op)
    return frozenset(found)


EXPENSIVE_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_int_mm", "convolution", "_convolution",
    "_fft_r2c", "_fft_c2r", "_fft_c2c",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_linalg_solve_ex", "linalg_lu_factor_ex", "_linalg_eigh", "_linalg_svd",
    "linalg_cholesky_ex", "linalg_solve_triangular", "triangular_solve", "linalg_qr",
)
"""The aten ops whose outputs ``"save_expensive"`` keeps: products, convolutions, FFTs,
attention, dense factorisations and solves — ops that cost more than a pass over their output."""


SAVE_FFT_OPS = _ops("_fft_r2c", "_fft_c2r", "_fft_c2c")
"""The aten ops whose outputs ``"save_fft"`` keeps."""


def save_fft(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"save_fft"`` policy: save FFT outputs, prefer to recompute everything else."""
    if op in SAVE_FFT_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"save_expensive"`` policy as a selective-checkpoint policy function: save the
    outputs of :data:`EXPENSIVE_OPS`, prefer to recompute everything else. Compose your own
    policy from it: ``lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op is X else
    save_expensive(ctx, op, *a, **k)``."""
    if op in EXPENSIVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def policy_name(policy: Any) -> str:
    """A short label for a policy: its name, the function's name, or ``"ops[k]"``."""
    if policy is None:
        return "none"
    if isinstance(policy, CompiledPolicy):
        return f"compiled:{policy_name(policy.policy)}"
    if isinstance(policy, str):
        return policy
    if isinstance(policy, (list, tuple, set, frozenset)):
        return f"ops[{len(policy)}]"
    return getattr(policy, "__name__", type(policy).__name__)


def policy_context(policy: Any) -> Callable[[], tuple] | None:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that implements
    ``policy``, or ``None`` for ``"none"`` (no checkpoint at all). ``policy`` is a name from
    :data:`POLICIES`, a callable ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or bool)
    or a list of op overloads to save (``torch.ops.aten.mm.default``)."""
    if isinstance(policy, CompiledPolicy):
        return policy.context_fn
    if policy is None or policy == "none":
        return None
    if policy == "recompute_all":
        return noop_context_fn
    if policy == "save_expensive":
        return functools.partial(create_selective_checkpoint_contexts, save_expensive)
    if policy == "save_fft":
        return functools.partial(create_selective_checkpoint_contexts, save_fft)
    if isinstance(policy, str):
        raise ValueError(f"unroll: unknown policy {policy!r}; use one of {', '.join(POLICIES)}, "
                         "a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy or a list "
                         "of ops to save")
    if isinstance(policy, (list, tuple, set, frozenset)):
        ops = list(policy)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise ValueError(f"unroll: a policy list holds op overloads such as "
                                 f"torch.ops.aten.mm.default, got {op!r}")
        return functools.partial(create_selective_checkpoint_contexts, ops)
    if callable(policy):
        return functools.partial(create_selective_checkpoint_contexts, policy)
    raise ValueError(f"unroll: policy must be a name ({', '.join(POLICIES)}), a callable or a "
                     f"list of ops, got {type(policy).__name__}")


class CompiledPolicy:
    """A recomputation policy applied by ``torch.compile``: a kept step is recorded by the
    compiled function ``torch.compile(lambda i, *x: checkpoint(step, i, *x, context_fn=...))``,
    so the compiler's partitioner decides from the policy which intermediates the compiled
    forward saves for its backward and which the backward recomputes (in fused kernels).

    Eager selective checkpointing routes every aten op of the step through a Python dispatch
    mode twice (forward and recomputation); with ``CompiledPolicy`` that decision is made once, at
    compile time, and the recorded step runs as one compiled forward and one compiled
    backward. The first kept step pays the compilation (seconds to a minute); later steps
    and later unrolls of the same step reuse it (the compiled function is cached on this
    object per step function and state structure, so keep the object and pass it again).

    Args:
        policy: the policy inside: a name from :data:`POLICIES` other than ``"none"``, a
            policy function or a list of ops (as for ``unroll(policy=...)``).
        **options: keyword arguments for ``torch.compile`` (``mode``, ``backend``,
            ``dynamic``, ``fullgraph``...).

    Gradients equal plain autograd's up to the rounding of the compiled kernels (fused
    pointwise ops sum in another order: about 1e-6 relative in float32, 1e-15 in float64).
    A step that draws random numbers gets the compiler's random stream, not eager PyTorch's,
    in its kept steps: use an eager policy when the noise must match a plain run.
    """

    def __init__(self, policy: Any = "save_expensive", **options: Any):
        if policy is None or policy == "none" or isinstance(policy, CompiledPolicy):
            raise ValueError("CompiledPolicy: give the policy to compile in, e.g. "
                             "CompiledPolicy('save_fft'); 'none' and a nested CompiledPolicy "
                             "are not policies to compile")
        self.policy = policy
        context_fn = policy_context(policy)
        assert context_fn is not None  # None only for "none", refused above
        self.context_fn: Callable[[], tuple] = context_fn
        if policy == "recompute_all":  # torch.compile takes only selective-checkpoint contexts
            self.context_fn = functools.partial(create_selective_checkpoint_contexts,
                                                _recompute_everything)
        self.options = options
        self._cache: dict = {}

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"CompiledPolicy({self.policy!r}{opts})"

    def compiled_step(self, step: Step, preserve_rng: bool) -> Callable:
        """The compiled ``(i, *leaves) -> (next_leaves, outputs)`` of ``step``'s user
        function under this policy, created on first use and cached."""
        # the compiled function keeps its step (and so the step function) alive: an id in
        # the key cannot be reused by another function while the entry exists
        key = (id(step.fn), repr(step.spec), bool(step.has_output), preserve_rng)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        context_fn = self.context_fn

        def record(i, *leaves):  # later unrolls with the same key reuse this first step
            return checkpoint(lambda j, *x: step(list(x), j), i, *leaves, use_reentrant=False,
                              context_fn=context_fn, preserve_rng_state=preserve_rng)

        compiled = self._cache[key] = torch.compile(record, **self.options)
        return compiled


class Recorder:
    """Records a step under ``torch.utils.checkpoint`` (non-reentrant) with a policy's
    ``context_fn``; the checkpoint stashes the RNG and autocast state and replays them when
    the step's backward recomputes it.

    Under autocast the step runs with autocast's cast cache off: with the cache, a weight is
    cast once per autocast region, so the forward and the recomputation would run different
    numbers of casts and selective checkpointing could not match them. Each step then casts
    its weights itself, and its weight gradients are summed in the weights' own dtype."""

    __slots__ = ("context_fn", "preserve_rng", "compiled")

    def __init__(self, context_fn: Callable[[], tuple], preserve_rng: bool,
                 compiled: CompiledPolicy | None = None):
        self.context_fn = context_fn
        self.preserve_rng = preserve_rng
        self.compiled = compiled  # kept steps (not the structure-checking first call) compiled

    @staticmethod
    def _call(fn: Callable, i: int, *leaves: torch.Tensor):
        return fn(list(leaves), i)

    def __call__(self, fn: Callable, leaves: list[torch.Tensor], i: int):
        autocast = autocast_state()
        if not autocast:
            return self._record(fn, leaves, i)
        with Autocast(autocast, cache=False):
            return self._record(fn, leaves, i)

    def _record(self, fn: Callable, leaves: list[torch.Tensor], i: int):
        if self.compiled is not None and isinstance(fn, Step):
            return self.compiled.compiled_step(fn, self.preserve_rng)(i, *leaves)
        return checkpoint(self._call, fn, i, *leaves, use_reentrant=False,
                          context_fn=self.context_fn, preserve_rng_state=self.preserve_rng)
