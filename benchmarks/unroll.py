"""Time and memory of backpropagating through T Navier–Stokes steps, method by method.

    .venv/bin/python benchmarks/unroll.py               # T = 1000 and 4000 (about 10 minutes)
    .venv/bin/python benchmarks/unroll.py --quick       # T = 200, a smoke run

Each method runs in its own subprocess so that peak RSS is its own. Methods: plain autograd,
torch.utils.checkpoint over uniform sqrt(T) segments, deepsolve revolve with s in
{4, 10, 2 sqrt(T)}, deepsolve store_all. For every row: wall time of forward + backward,
peak RSS above the process's baseline (VmHWM after a reset through /proc/self/clear_refs),
peak live saved-for-backward bytes (saved_tensors_hooks), step evaluations, gradient error
against plain autograd, and for revolve the ideal time
``t(T, s) x (unrecorded step) + T x (recorded step + its backward)``: the step evaluations
timed inside the run itself plus T calibrated backward passes of one recorded step, so that
``wall / ideal - 1`` is what the executor adds. A second table gives the executor's own
overhead per step evaluation on a tiny 16-float state (n = 10^4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

import torch

from deepsolve.memory.meter import process_status, reset_high_water_mark

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)






class SavedBytes:
    """Live bytes saved for backward, and their peak (hooks add ~1-2% to a recorded step)."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def pack(self, t):
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        box = _Box(t)
        weakref.finalize(box, self._release, nbytes)
        return box

    def _release(self, nbytes):
        self.live -= nbytes

    @staticmethod
    def unpack(box):
        return box.t


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def child(method: str, T: int, s: int, out: str) -> dict:
    import ns_step
    from torch.utils.checkpoint import checkpoint

    import deepsolve
    from deepsolve.schedules import optimal_cost

    torch.set_num_threads(1)
    step, w0, closure = ns_step.make()
    params = list(closure.parameters())
    counts = {"unrecorded": 0, "recorded": 0}
    spent = {"unrecorded": 0.0, "recorded": 0.0}
    clock = time.perf_counter

    def counted(w, i):
        key = "recorded" if torch.is_grad_enabled() else "unrecorded"
        t0 = clock()
        y = step(w, i)
        spent[key] += clock() - t0
        counts[key] += 1
        return y

    # calibration: one unrecorded step, one recorded step + its backward
    x = w0.detach()
    with torch.no_grad():
        for i in range(5):
            x = step(x, i)
        t_unrec = []
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(20):
                x = step(x, i)
            t_unrec.append((time.perf_counter() - t0) / 20)
    t_rec, t_bwd = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        back = 0.0
        for i in range(10):
            xi = x.detach().requires_grad_()
            y = step(xi, i)
            t1 = time.perf_counter()
            torch.autograd.grad(y, [xi, *params], torch.ones_like(y))
            back += time.perf_counter() - t1
        t_rec.append((time.perf_counter() - t0) / 10)
        t_bwd.append(back / 10)
    unrec, rec, bwd = (statistics.median(v) for v in (t_unrec, t_rec, t_bwd))
    for p in params:
        p.grad = None

    w = w0.detach().clone().requires_grad_()
    hooks = SavedBytes()
    can_reset = reset_high_water_mark()
    base = process_status("VmRSS")
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        if method == "plain":
            y = w
            for i in range(T):
                y = counted(y, i)
        elif method == "checkpoint":
            k = math.isqrt(T)

            def segment(z, a, b):
                for i in range(a, b):
                    z = counted(z, i)
                return z

            y = w
            for a in range(0, T, k):
                y = checkpoint(segment, y, a, min(a + k, T), use_reentrant=False)
        elif method == "store_all":
            y = deepsolve.unroll(counted, w, T, schedule="store_all")
        elif method == "revolve":
            y = deepsolve.unroll(counted, w, T, snapshots=s)
        else:
            raise SystemExit(f"unknown method {method}")
        loss = (y**2).mean()
        loss.backward()
    wall = time.perf_counter() - t0
    peak = process_status("VmHWM") - base if can_reset else process_status("VmHWM")
    torch.save([w.grad, *[p.grad for p in params]], out)
    row = {
        "method": method, "T": T, "s": s, "wall": wall, "peak_rss": peak,
        "saved_peak": hooks.peak, "unrecorded": counts["unrecorded"],
        "recorded": counts["recorded"], "t_unrec": unrec, "t_rec": rec,
        "state_bytes": w0.numel() * w0.element_size(), "hwm_reset": can_reset,
    }
    if method == "revolve":
        # the ideal executor: the step evaluations it must make, timed in this very run,
        # plus T backward passes of one recorded step (calibrated above), and nothing else
        assert counts["unrecorded"] == optimal_cost(T, s) and counts["recorded"] == T
        row["ideal"] = spent["unrecorded"] + spent["recorded"] + T * bwd
    return row


def overhead_table(runs_only: bool = False) -> list[str] | dict[str, float]:
    """Executor overhead per step evaluation on a 16-float state, n = 10^4 (``runs_only``:
    the medians of the store_all and revolve s = 10, 100 runs only)."""
    import deepsolve
    from deepsolve.schedules import optimal_cost

    torch.set_num_threads(1)
    w = torch.tensor(0.999, requires_grad=True)

    def step(x, i):
        return x * w

    x0 = torch.randn(16, requires_grad=True)
    n = 10_000

    def unrec_time():
        with torch.no_grad():
            t = time.perf_counter()
            x = x0
            for i in range(n):
                x = step(x, i)
        return (time.perf_counter() - t) / n

    def rec_time():
        t = time.perf_counter()
        for i in range(n):
            xi = x0.detach().requires_grad_()
            torch.autograd.grad(step(xi, i), [xi, w], torch.ones(16))
        return (time.perf_counter() - t) / n

    def plain():
        t = time.perf_counter()
        x = x0
        for i in range(n):
            x = step(x, i)
        x.sum().backward()
        return time.perf_counter() - t

    def run(**kw):
        t = time.perf_counter()
        deepsolve.unroll(step, x0, n, **kw).sum().backward()
        return time.perf_counter() - t

    run(snapshots=10)
    if runs_only:  # the wall times alone, for benchmarks/engine_ab.py
        return {"store_all": statistics.median(run(schedule="store_all") for _ in range(3)),
                **{f"revolve s={s}": statistics.median(run(snapshots=s) for _ in range(3))
                   for s in (10, 100)}}
    u = statistics.median(unrec_time() for _ in range(3))
    r = statistics.median(rec_time() for _ in range(3))
    lines = ["| method | wall [s] | evaluations | ideal [s] | overhead per evaluation [µs] |",
             "|---|---|---|---|---|"]
    t = statistics.median(plain() for _ in range(3))
    lines.append(f"| plain autograd | {t:.3f} | {n} | — | — |")
    t = statistics.median(run(schedule="store_all") for _ in range(3))
    lines.append(f"| store_all | {t:.3f} | {n} | — | — |")
    for s in (10, 100, n):
        t = statistics.median(run(snapshots=s) for _ in range(3))
        adv = optimal_cost(n, s)
        ideal = adv * u + n * r
        lines.append(f"| revolve s={s} | {t:.3f} | {adv + n} | {ideal:.3f} | "
                     f"{(t - ideal) / (adv + n) * 1e6:.1f} |")
    lines.append("")
    lines.append(f"unrecorded step {u * 1e6:.1f} µs, recorded step + backward {r * 1e6:.1f} µs")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T = 200 only")
    ap.add_argument("--steps", type=int, nargs="*", help="values of T (default 1000 4000)")
    ap.add_argument("--child", nargs=4, metavar=("METHOD", "T", "S", "OUT"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--overhead-json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.overhead_json:
        import deepsolve

        print(json.dumps({"where": deepsolve.__file__, **overhead_table(runs_only=True)}))
        return
    if args.child:
        m, T, s, out = args.child
        print(json.dumps(child(m, int(T), int(s), out)))
        return
    Ts = args.steps or ([200] if args.quick else [1000, 4000])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for T in Ts:
            methods = [("plain", 0), ("checkpoint", 0), ("store_all", 0),
                       ("revolve", 4), ("revolve", 10), ("revolve", 2 * math.isqrt(T))]
            ref = None
            for m, s in methods:
                out = os.path.join(tmp, f"{m}_{T}_{s}.pt")
                res = subprocess.run([sys.executable, __file__, "--child", m, str(T), str(s), out],
                                     capture_output=True, text=True, check=True)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                grads = torch.load(out)
                if ref is None:
                    ref = grads
                num = sum(((a - b).double() ** 2).sum() for a, b in zip(grads, ref, strict=True))
                den = sum((b.double() ** 2).sum() for b in ref)
                row["grad_err"] = math.sqrt(num / den)
                rows.append(row)
                print(f"  done {m} T={T} s={s}: {row['wall']:.1f}s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("| T | method | wall [s] | peak RSS [MiB] | saved tensors peak [MiB] | unrecorded "
          "| recorded | grad rel. err | ideal [s] | wall / ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["method"] + (f" s={r['s']}" if r["method"] == "revolve" else "")
        if r["method"] == "checkpoint":
            name = f"torch.utils.checkpoint, {math.isqrt(r['T'])}-step segments"
        ideal = f"{r['ideal']:.1f}" if "ideal" in r else "—"
        ratio = f"{r['wall'] / r['ideal']:.3f}" if "ideal" in r else "—"
        print(f"| {r['T']} | {name} | {r['wall']:.1f} | {r['peak_rss'] / 2**20:.0f} | "
              f"{r['saved_peak'] / 2**20:.1f} | {r['unrecorded']} | {r['recorded']} | "
              f"{r['grad_err']:.1e} | {ideal} | {ratio} |")
    for T in Ts:
        by = {(r["method"], r["s"]): r for r in rows if r["T"] == T}
        plain = by[("plain", 0)]
        best = max((r for r in rows if r["T"] == T and r["method"] == "revolve"),
                   key=lambda r: plain["peak_rss"] / max(r["peak_rss"], 1))
        print(f"\nT={T}: plain autograd peak RSS / revolve s={best['s']} peak RSS = "
              f"{plain['peak_rss'] / max(best['peak_rss'], 1):.0f}x; saved-tensor ratio "
              f"{plain['saved_peak'] / max(best['saved_peak'], 1):.0f}x; "
              f"store_all / plain time = {by[('store_all', 0)]['wall'] / plain['wall']:.2f}")
    print(f"\none unrecorded step {rows[0]['t_unrec'] * 1e3:.2f} ms, recorded step + backward "
          f"{rows[0]['t_rec'] * 1e3:.2f} ms, state {rows[0]['state_bytes']} B "
          "(64x64 float32, 1 thread)")
    print("\nExecutor overhead, 16-float state, n = 10^4 (medians of 3):\n")
    print("\n".join(overhead_table()))


if __name__ == "__main__":
    main()
