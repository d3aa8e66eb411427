"""A/B of the engine: today's tree against an earlier commit, interleaved in one run.

    .venv/bin/python benchmarks/engine_ab.py --base 97d875e            # 3 rounds (~6 min)
    .venv/bin/python benchmarks/engine_ab.py --base 97d875e --rounds 5

The earlier commit is exported (``git archive``) to a temporary folder; every round runs each
measurement once per tree, in alternating order, each in its own subprocess with
``PYTHONPATH`` pointing at that tree's ``deepsolve`` (the printed paths say which was
imported); the harness is this tree's ``benchmarks/unroll.py`` for both. Measurements, the
rows of ``benchmarks/unroll.py``:

* the executor's overhead: forward + backward of ``n = 10^4`` steps of ``x * w`` on a 16-float
  state under store_all and revolve s = 10, 100 (medians of 3 inside each run);
* T = 1000 Navier–Stokes steps (64x64, float32, 1 thread) under revolve s = 10 and
  store_all (``benchmarks/unroll.py``'s child).

The table gives each tree's median over rounds and the ratio new / base; on this shared
2-core machine a ratio within a few per cent of 1 is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

def _export(rev: str, dest: str) -> None:
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "deepsolve"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=tar, check=True)


def _run(tree: str, args: list[str]) -> dict:
    """benchmarks/unroll.py (this tree's harness) with ``tree``'s deepsolve imported."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(HERE, "unroll.py"), *args],
                         capture_output=True, text=True, env=env, check=True, cwd=tree)
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(tree: str, tmp: str) -> dict:
    row = _run(tree, ["--overhead-json"])
    for method, s in (("revolve", 10), ("store_all", 0)):
        out = os.path.join(tmp, f"g_{method}.pt")
        child = _run(tree, ["--child", method, "1000", str(s), out])
        row[f"NS T=1000 {method}" + (f" s={s}" if s else "")] = child["wall"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        _export(args.base, base)
        trees = {"base": base, "new": ROOT}
        rows: dict[str, list[dict]] = {"base": [], "new": []}
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            for name in order:
                rows[name].append(measure(trees[name], tmp))
                print(f"  round {r + 1} {name} done", file=sys.stderr)
    print(f"imported: base {rows['base'][0]['where']}, new {rows['new'][0]['where']}\n")
    keys = [k for k in rows["new"][0] if k != "where"]
    print(f"| measurement [s] | base ({args.base}) | new | new / base |")
    print("|---|---|---|---|")
    for k in keys:
        b = statistics.median(x[k] for x in rows["base"])
        n = statistics.median(x[k] for x in rows["new"])
        print(f"| {k} | {b:.3f} | {n:.3f} | {n / b:.3f} |")
    print(f"\nmedians of {args.rounds} interleaved rounds; the overhead rows are themselves "
          "medians of 3 runs of n = 10^4 steps")


if __name__ == "__main__":
    main()
