"""One plan for every rank: the planner's inputs reduced over a process group.

When the ranks of a domain decomposition unroll a step that communicates (halo exchanges),
every rank must run the same schedule: a recomputation on one rank that the others do not
make would wait forever for its neighbours. Each rank profiles *its* step (its block), and
before choosing, the ranks agree on the worst case: the largest sizes and times of every
profile field, the smallest budget (and online slot count), the smallest second-level room
and the slowest second level. The planner is deterministic, so from equal inputs every
rank picks the same plan, the one that fits the tightest rank.

A profile one rank could not take (a policy its step fails under) counts as failed on all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["group_size", "agree_profile", "agree_min", "agree_max", "agree_max_time",
           "agree_level"]


def group_size(group: Any) -> int:
    """The size of ``group`` (``None``, or no process group running: 1)."""
    dist = torch.distributed
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _reduce(values: list[float], group: Any, op: str) -> list[float]:
    dist = torch.distributed
    dev = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    return t.tolist()


_NUMBER = (int, float)


def agree_profile(prof: Any, group: Any) -> Any:
    """The field-wise maximum of every rank's :class:`StepProfile` (``None``: the rank has
    none; then ``None`` on every rank). ``measured`` is true only if it is on every rank;
    optional fields (``None`` here) stay ``None`` only where they are ``None`` on every rank.
    """
    if group_size(group) == 1:
        return prof
    from .profiling import StepProfile

    fields = [f.name for f in dataclasses.fields(StepProfile)
              if f.name not in ("device", "policy")]
    vals = [0.0 if prof is None else 1.0]
    for name in fields:
        v = None if prof is None else getattr(prof, name)
        if isinstance(v, bool):
            vals.append(-2.0 if v else -1.0)   # any False (-1) wins the max
        elif isinstance(v, _NUMBER):
            vals.append(float(v))
        else:
            vals.append(-3.0)                  # None
    # "present" must hold on every rank: reduce its negation with the rest by max
    vals[0] = -vals[0]
    out = _reduce(vals, group, "max")
    if out[0] > -1.0 or prof is None:          # some rank has no profile
        return None
    agreed: dict[str, Any] = {}
    for name, v, w in zip(fields, (getattr(prof, f) for f in fields), out[1:], strict=True):
        if isinstance(v, bool):
            agreed[name] = w == -2.0          # True on every rank
        elif isinstance(v, int):
            agreed[name] = int(w)
        elif isinstance(v, float):
            agreed[name] = float(w)
        else:
            agreed[name] = None if w == -3.0 else (int(w) if float(w).is_integer() else w)
    return dataclasses.replace(prof, **agreed)


def agree_min(value: int, group: Any) -> int:
    """The smallest value over the ranks: a budget (``"80%"`` resolves per device), an
    online slot count."""
    if group_size(group) == 1:
        return value
    return int(_reduce([float(value)], group, "min")[0])


def agree_max(value: int, group: Any) -> int:
    """The largest value over the ranks: one-time library memory."""
    if group_size(group) == 1:
        return value
    return int(_reduce([float(value)], group, "max")[0])


def agree_max_time(value: float, group: Any) -> float:
    """The largest time over the ranks [s]: the slowest rank's inverse step."""
    if group_size(group) == 1:
        return value
    return float(_reduce([float(value)], group, "max")[0])


def agree_level(level: Any, group: Any) -> Any:
    """A second storage level every rank can use: the fewest slots, the slowest writes and
    reads."""
    if level is None or group_size(group) == 1:
        return level
    slots = _reduce([float(level.slots)], group, "min")[0]
    t_write, t_read = _reduce([level.t_write, level.t_read], group, "max")
    return dataclasses.replace(level, slots=int(slots), t_write=t_write, t_read=t_read)
