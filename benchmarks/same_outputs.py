"""Does a change to the trainer keep its outputs? The logs of the shipped problems, compared.

    .venv/bin/python benchmarks/same_outputs.py --save /tmp/before     # on the old checkout
    .venv/bin/python benchmarks/same_outputs.py --compare /tmp/before  # on the new one
    PYTHONPATH=/path/to/old/checkout .venv/bin/python benchmarks/same_outputs.py --save DIR

Each problem in ``problems/`` is trained for ``--iterations`` iterations (default 3) in float64
through the CLI (``python -m deepsolve train``, a fresh process each, one thread, compiled
segments off), and its ``log.h5`` is reduced to a record: the column names in order, the
file's attributes that do not depend on the machine or the moment, and every value of the
deterministic columns as the exact bits of the float64 (``float.hex``). ``--compare`` fails
(exit status 1) on the first difference and names it.

Left out of the comparison, as they change from one run of the same code to the next: the
wall-clock and memory columns (``time*``, ``peak_*``, ``compile_time``), ``budget_bytes``
(a ``"%"`` budget follows the memory that is free) and the attributes that record the
machine, the moment, the git commit and the versions. The schedule and step counts are
compared: the planner's choice depends on measured times, so a difference there is reported
as such (a problem whose plan is close to a tie may differ between runs of the same code:
run ``--save`` twice to see).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOLATILE_COLUMNS = ("time", "peak_", "compile_time", "budget_bytes")
VOLATILE_ATTRS = ("created", "git_commit", "host", "start_time", "torch_version",
                  "python_version", "deepsolve_version", "cuda_version", "device_name",
                  "problem_file", "budget_bytes")


def _volatile(name: str) -> bool:
    return any(name.startswith(p) for p in VOLATILE_COLUMNS)


def _exact(v):
    if isinstance(v, float):
        return "nan" if math.isnan(v) else v.hex()
    return v


def record(log_path: str) -> dict:
    """The comparable content of one log."""
    import numpy as np

    from deepsolve.io import read_log

    log = read_log(log_path)
    out: dict = {"columns": list(log.columns), "values": {}, "attrs": {}}
    for c, vals in log.columns.items():
        if _volatile(c):
            continue
        arr = np.asarray(vals)
        if arr.dtype.kind == "f":
            out["values"][c] = [_exact(float(x)) for x in arr.ravel()]
        else:
            out["values"][c] = [x.decode() if isinstance(x, bytes) else
                                x.item() if hasattr(x, "item") else x for x in arr.ravel()]
    for k, v in log.attrs.items():
        if k not in VOLATILE_ATTRS and not _volatile(k):
            out["attrs"][k] = v
    return json.loads(json.dumps(out, default=str))


def run(problem: str, iterations: int, tmp: str) -> dict:
    out = os.path.join(tmp, os.path.splitext(os.path.basename(problem))[0])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "deepsolve", "train", problem, "--out", out, "--quiet",
           "--iterations", str(iterations), "--dtype", "float64", "--threads", "1",
           "--set", "compile=off"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return record(os.path.join(out, "log.h5"))


def diff(name: str, a: dict, b: dict, ignore: tuple[str, ...] = ()) -> str | None:
    """The first difference between two records of one problem, or None (the attributes
    ``ignore`` left out)."""
    if a["columns"] != b["columns"]:
        return f"{name}: columns differ: {a['columns']} != {b['columns']}"
    for k in sorted(set(a["attrs"]) | set(b["attrs"])):
        if k in VOLATILE_ATTRS or _volatile(k) or k in ignore:  # (or saved before the key was)
            continue
        if a["attrs"].get(k) != b["attrs"].get(k):
            return f"{name}: attribute {k}: {a['attrs'].get(k)!r} != {b['attrs'].get(k)!r}"
    for c in a["values"]:
        if a["values"][c] != b["values"].get(c):
            return f"{name}: column {c}: {a['values'][c]} != {b['values'].get(c)}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", metavar="DIR", help="write the records to DIR")
    g.add_argument("--compare", metavar="DIR", help="compare with the records in DIR")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--problems", nargs="*", help="problem files (default: problems/*.py)")
    ap.add_argument("--ignore", action="append", default=[], metavar="ATTR",
                    help="leave this file attribute out of the comparison, e.g. "
                    "problem_sha256 when a problem file's text changed but not what it "
                    "computes (repeatable)")
    args = ap.parse_args()
    problems = args.problems or sorted(
        os.path.join("problems", p) for p in os.listdir(os.path.join(ROOT, "problems"))
        if p.endswith(".py") and not p.startswith("_"))
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for p in problems:
            name = os.path.splitext(os.path.basename(p))[0]
            got = run(p, args.iterations, tmp)
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                with open(os.path.join(args.save, f"{name}.json"), "w") as f:
                    json.dump(got, f, indent=1)
                print(f"{name}: {len(got['columns'])} columns, "
                      f"{len(next(iter(got['values'].values()), []))} rows saved")
                continue
            with open(os.path.join(args.compare, f"{name}.json")) as f:
                want = json.load(f)
            why = diff(name, want, got, tuple(args.ignore))
            failed += why is not None
            print(why or f"{name}: the same ({len(got['columns'])} columns, "
                  f"{len(got['values'])} compared bit for bit)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
