"""Benchmark: stream deepsolve's revolve against checkpoint_schedules' binomial schedule.

For each (n, s) the script measures, for ``deepsolve.schedules.revolve(n, s)`` and for the
peer ``checkpoint_schedules.MultistageCheckpointSchedule(n, s, 0)`` (both count ``x_0`` as a
snapshot):

* the time to build the schedule and stream all its actions (iterate and count), median of
  ``--repeat`` runs, without tracemalloc;
* actions per second;
* the peak Python memory while streaming (tracemalloc, a separate pass: tracemalloc slows
  the stream down);
* unrecorded advances (both must equal ``optimal_cost(n, s)``) and snapshot writes.

Measurements run one after another in this process. Usage::

    .venv/bin/python benchmarks/schedules.py            # n = 1e4, 1e5, 1e6; s = 10, 50, 100
    .venv/bin/python benchmarks/schedules.py --quick    # n = 1e4, 1e5; s = 10, 50

checkpoint_schedules (LGPL) is a benchmark dependency only: ``pip install checkpoint-schedules``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepsolve.schedules import Advance, Store, optimal_cost, revolve  # noqa: E402

try:
    import checkpoint_schedules as cs
except ImportError:  # pragma: no cover
    sys.exit("benchmarks/schedules.py needs the peer library: pip install checkpoint-schedules")


# --- the two schedules: stream-and-count, and count advances/writes --------------------------

def ours_stream(n: int, s: int) -> int:
    count = 0
    for _ in revolve(n, s):
        count += 1
    return count


def peer_stream(n: int, s: int) -> int:
    end = cs.EndReverse
    count = 0
    for action in cs.MultistageCheckpointSchedule(n, s, 0):
        count += 1
        if type(action) is end:
            break
    return count


def ours_counts(n: int, s: int) -> tuple[int, int, int]:
    """(actions, unrecorded advances, snapshot writes incl. the store of x_0)."""
    actions = advances = writes = 0
    for a in revolve(n, s):
        actions += 1
        t = type(a)
        if t is Advance:
            advances += a.stop - a.start
        elif t is Store:
            writes += 1
    return actions, advances, writes


def peer_counts(n: int, s: int) -> tuple[int, int, int]:
    """(actions, unrecorded advances, snapshot writes): Forward with write_adj_deps=False
    advances len(action) steps unrecorded; write_ics=True is one snapshot write."""
    fwd, end = cs.Forward, cs.EndReverse
    actions = advances = writes = 0
    for a in cs.MultistageCheckpointSchedule(n, s, 0):
        actions += 1
        t = type(a)
        if t is fwd:
            if not a.write_adj_deps:
                advances += len(a)
            if a.write_ics:
                writes += 1
        elif t is end:
            break
    return actions, advances, writes


# --- measurements --------------------------------------------------------------------------

def median_time(fn: Callable[[int, int], int], n: int, s: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn(n, s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_kib(fn: Callable[[int, int], tuple[int, int, int]], n: int, s: int):
    """Run ``fn`` under tracemalloc; return (its result, peak KiB above the starting level)."""
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = fn(n, s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, (peak - base) / 1024


def measure(n: int, s: int, repeat: int) -> dict:
    opt = optimal_cost(n, s)
    row: dict = {"n": n, "s": s, "optimal": opt}
    for name, stream, counts in (("ours", ours_stream, ours_counts),
                                 ("peer", peer_stream, peer_counts)):
        (actions, advances, writes), kib = peak_kib(counts, n, s)
        if advances != opt:
            raise SystemExit(f"{name}: {advances} advances at n={n}, s={s}; optimal_cost={opt}")
        t = median_time(stream, n, s, repeat)
        row[name] = {"actions": actions, "advances": advances, "writes": writes,
                     "time": t, "rate": actions / t, "kib": kib}
    return row


def markdown(rows: list[dict]) -> str:
    head = ("| n | s | advances | deepsolve writes | peer writes | deepsolve time [s] | "
            "peer time [s] | ratio (peer/deepsolve) | deepsolve actions/s | "
            "deepsolve peak KiB | peer peak KiB |")
    lines = [head, "|" + "---:|" * 11]
    for r in rows:
        o, p = r["ours"], r["peer"]
        lines.append(
            f"| {r['n']:,} | {r['s']} | {o['advances']:,} | {o['writes']:,} | "
            f"{p['writes']:,} | {o['time']:.3f} | {p['time']:.3f} | "
            f"{p['time'] / o['time']:.1f} | {o['rate']:,.0f} | {o['kib']:.1f} | {p['kib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fast subset: n = 1e4, 1e5 and s = 10, 50")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timing runs per schedule; the median is reported (default 3)")
    args = ap.parse_args(argv)
    ns = [10**4, 10**5] if args.quick else [10**4, 10**5, 10**6]
    ss = [10, 50] if args.quick else [10, 50, 100]

    try:
        peer_version = metadata.version("checkpoint_schedules")
    except metadata.PackageNotFoundError:  # pragma: no cover
        peer_version = "?"
    print(f"# Schedules: deepsolve.revolve vs checkpoint_schedules {peer_version}")
    print(f"python {sys.version.split()[0]}; median of {args.repeat} timing runs; "
          "peak memory from a separate tracemalloc pass\n", flush=True)
    rows = []
    for n in ns:
        for s in ss:
            rows.append(measure(n, s, args.repeat))
            r = rows[-1]
            print(f"  n={n:>9,} s={s:>3}: deepsolve {r['ours']['time']:.3f} s, "
                  f"peer {r['peer']['time']:.3f} s", file=sys.stderr, flush=True)
    print(markdown(rows))

    print("\nSnapshot writes (x_0 included), same unrecorded advances:\n")
    print("| n | s | advances | deepsolve writes | peer writes |")
    print("|---:|---:|---:|---:|---:|")
    for n, s in ((10**4, 20), (100, 50)):
        _, adv, ours_w = ours_counts(n, s)
        _, peer_adv, peer_w = peer_counts(n, s)
        assert adv == peer_adv == optimal_cost(n, s)
        print(f"| {n:,} | {s} | {adv:,} | {ours_w:,} | {peer_w:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
