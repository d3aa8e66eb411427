"""The engine room: how a checkpoint schedule is run under autograd.

One concept per module, each depending only on those listed before it:

* :mod:`~deepsolve.engine.state` — states as pytrees of tensors, flattened to leaves; the
  checked step wrapper :class:`Step`.
* :mod:`~deepsolve.engine.graph` — autograd graph inspection: parameter discovery, the
  per-recording check that nothing differentiable is missed, constant leaves, saved bytes.
* :mod:`~deepsolve.engine.replay` — random-number and autocast replay (:class:`Replay`).
* :mod:`~deepsolve.engine.policies` — recomputation policies inside a kept step.
* :mod:`~deepsolve.engine.storage` — snapshot slots (:class:`Slot`) and storage levels
  (:class:`Storage`, :class:`HostStorage`).
* :mod:`~deepsolve.engine.finite` — the forward sweep's watch for NaN and inf states
  (:class:`FiniteCheck`, :class:`NonFiniteError` naming the first bad step).
* :mod:`~deepsolve.engine.reversal` — the inverse of a reversible step, checked on the first
  step pair, and the drift of rebuilt states (:class:`Reversal`).
* :mod:`~deepsolve.engine.segments` — compiled step segments: ``k`` steps as one compiled
  step of a shorter chain (:class:`Segments`), checked against the eager steps at the first
  call.
* :mod:`~deepsolve.engine.interpreter` — the one action interpreter
  (:class:`Interpreter`) that :func:`deepsolve.unroll` and :func:`deepsolve.sequential` drive.
* :mod:`~deepsolve.engine.executor` — :func:`execute`, the unroll's autograd Function.

The engine knows nothing of budgets or files (layer 2 of docs/design.md). Other packages
import only the public names re-exported here.
"""

from .executor import Tape, Truncation, UnrollRun, UnrollStats, check_truncate, execute
from .finite import EVERY, FiniteCheck, NonFiniteError, all_finite
from .graph import (
    closure_leaves,
    constant_leaves,
    discover,
    graph_leaves,
    graph_nodes,
    pull_back,
    saved_bytes,
    sequence_marker,
    unseen_leaf,
)
from .interpreter import GradSum, Interpreter, Misfit, SweepStats, holding
from .policies import (
    EXPENSIVE_OPS,
    POLICIES,
    SAVE_FFT_OPS,
    CompiledPolicy,
    Recorder,
    policy_context,
    policy_name,
    save_expensive,
    save_fft,
)
from .replay import Autocast, Replay, autocast_state, cuda_devices
from .reversal import ON_DRIFT, ReconstructionError, Reversal, default_tolerance, relative_error
from .rng import RngState, cuda_generators
from .segments import (
    FORMS,
    INDEX,
    UNROLLED_MAX,
    CompileError,
    Segments,
    StepCache,
    forget_step,
    loop_refused,
    segment_count,
    segments,
    step_identity,
)
from .state import Step, codec, flatten_state, is_diff, spec_str, unflatten
from .storage import (
    POOL_BELOW,
    HostStorage,
    Slot,
    SnapshotPool,
    Storage,
    check_snapshot_dtype,
    snapshot_nbytes,
)

__all__ = [
    "EVERY", "FiniteCheck", "NonFiniteError", "all_finite",
    "CompileError", "INDEX", "FORMS", "UNROLLED_MAX", "Segments", "segment_count",
    "segments", "step_identity", "loop_refused",
    "StepCache", "forget_step",
    "Autocast", "CompiledPolicy", "ON_DRIFT", "EXPENSIVE_OPS", "GradSum", "HostStorage",
    "Interpreter",
    "Misfit", "POLICIES", "POOL_BELOW", "ReconstructionError", "Recorder", "Replay", "Reversal",
    "RngState", "cuda_generators",
    "SAVE_FFT_OPS", "Slot", "default_tolerance", "relative_error",
    "SnapshotPool", "Step", "Storage",
    "SweepStats", "Tape", "UnrollRun", "UnrollStats", "autocast_state", "check_snapshot_dtype",
    "check_truncate", "Truncation",
    "closure_leaves", "codec", "constant_leaves", "cuda_devices", "discover", "execute",
    "flatten_state", "graph_leaves", "graph_nodes", "holding", "is_diff",
    "policy_context",
    "policy_name", "pull_back", "save_expensive", "save_fft", "saved_bytes", "sequence_marker",
    "snapshot_nbytes", "spec_str", "unflatten", "unseen_leaf",
]
