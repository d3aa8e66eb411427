"""Command line: ``python -m deepsolve <command> ...``. Argument parsing only."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return v


def _cmd_plan(args: argparse.Namespace) -> int:
    from .memory.strategies import Periodic, Revolve, StoreAll
    from .schedules.diagram import png_diagram, summary, text_diagram

    if args.problem:
        from .train import plan_problem

        overrides = {"steps": args.steps, "threads": args.threads}
        print(plan_problem(args.problem, budget=args.budget or None, sets=args.set,
                           overrides=overrides).explain())
        return 0
    if args.steps is None:
        raise ValueError("give a problem file, or --steps N (and --snapshots S)")
    if args.png:
        _check_output_file("--png", args.png)
    if args.schedule == "revolve" and args.snapshots is None:
        raise ValueError("revolve needs --snapshots S (S >= 1), or choose --schedule "
                         "periodic or store_all")
    how = {"revolve": lambda: Revolve(args.snapshots), "periodic": lambda: Periodic(args.every),
           "store_all": StoreAll}[args.schedule]()
    sched = how.build(args.steps)
    print(summary(sched))
    if args.show:
        print()
        print(text_diagram(sched))
    if args.png:
        try:
            png_diagram(sched, args.png)
        except ImportError:
            raise ValueError("--png needs matplotlib (pip install matplotlib)") from None
        except OSError as e:
            raise ValueError(f"--png {args.png}: cannot write it ({e.strerror or e})") from None
        print(f"diagram written to {args.png}")
    return 0


def _check_output_file(option: str, path: str) -> None:
    """A one-line ``ValueError`` unless ``path`` can be a new or replaced file: not a
    directory, in an existing directory."""
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a directory; give a file name, e.g. "
                         f"{os.path.join(path, 'plan.png')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {path}: the directory {parent} does not exist")


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, train

    overrides = {k: getattr(args, k) for k in ("iterations", "steps", "budget", "snapshots",
                                               "device", "dtype", "seed", "lr", "threads",
                                               "tensorboard")}
    res = train(args.problem, overrides=overrides, sets=args.set, out=args.out,
                resume=args.resume, quiet=args.quiet,
                locking=False if args.no_file_locking else None)
    code = INTERRUPTED_EXIT_CODE if res.interrupted else PREEMPTED_EXIT_CODE
    if res.rank != 0:  # distributed run: rank 0 reports
        return code if res.preempted else 0
    if res.preempted:
        how = "interrupted" if res.interrupted else "stopped by a signal"
        when = (f"after iteration {res.iterations - 1}" if res.iterations > 0 else
                "before its first iteration (while the run was set up)")
        print(f"{how} {when}; restart file {res.restart_path} (iteration {res.iterations}); "
              "continue with --resume", file=sys.stderr)
        return code
    already = "the run had already finished: " if res.nothing_to_train and not \
        res.stopped.startswith("time_limit") else ""
    print(f"{already}trained {res.iterations} iterations, final loss {res.final_loss:.4e}")
    if res.metrics:
        print("final metrics: " + ", ".join(f"{k} {v:.4g}" for k, v in res.metrics.items()))
    print(f"log: {res.log_path}")
    print(f"restart file: {res.restart_path}")
    print(f"summary and plots: python -m deepsolve report {res.run_dir}")
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from .slurm import SubmitSpec, submit

    spec = SubmitSpec.create(args.problem, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                             time=args.time, tasks_per_node=args.tasks_per_node,
                             cpus_per_task=args.cpus_per_task, partition=args.partition,
                             account=args.account, out=args.out, job_name=args.job_name,
                             port=args.port, train_args=args.train_args)
    res = submit(spec, dry_run=args.dry_run)
    if not res.submitted:
        print(res.script)
    print(res.message, file=sys.stderr if not res.submitted else sys.stdout)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .training.check import check_problem

    overrides = {k: getattr(args, k) for k in ("budget", "snapshots", "device", "dtype", "seed",
                                               "threads")}
    res = check_problem(args.problem, steps=args.steps, sets=args.set, overrides=overrides,
                        rtol=args.rtol)
    print(res.table())
    return 0 if res.ok else 1


def _cmd_settings(args: argparse.Namespace) -> int:
    from .problem import load_problem
    from .settings import describe

    problem, _ = load_problem(args.problem)
    print(describe(problem.settings()))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .io.report import report

    print(report(args.run_dir, out_dir=args.out,
                 locking=False if args.no_file_locking else None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepsolve",
        description="Train through long iterative computations with checkpointed, "
        "memory-bounded exact gradients.",
    )
    from ._version import __version__

    p.add_argument("--version", action="version", version=f"deepsolve {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    plan = sub.add_parser("plan", help="show a checkpoint schedule and its cost",
                          description="With a problem file: the schedule the planner picks for "
                          "the problem's unroll under --budget (default: the problem's own "
                          "budget setting) and the alternatives it weighed. With "
                          "--steps/--snapshots: a schedule's cost (advances, recompute factor, "
                          "peak slots) and, with --show, its diagram.")
    plan.add_argument("problem", nargs="?", help="problem file (problems/NAME.py)")
    plan.add_argument("--budget", help="memory budget: bytes, 512MiB, 2GB, 12 GiB or 80%% "
                      "(default with a problem file: its budget setting)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a problem setting (repeatable)")
    plan.add_argument("--steps", type=_positive_int, help="number of steps N")
    plan.add_argument("--snapshots", type=_positive_int,
                      help="snapshot slots S, the initial state included")
    plan.add_argument("--schedule", choices=["revolve", "periodic", "store_all"],
                      default="revolve", help="schedule kind (default: revolve)")
    plan.add_argument("--every", type=_positive_int, default=None,
                      help="periodic: checkpoint interval (default ceil(sqrt(N)))")
    plan.add_argument("--show", action="store_true",
                      help="print the diagram (time down, step index across; N <= 80)")
    plan.add_argument("--png", metavar="FILE", help="draw the diagram into FILE with matplotlib")
    plan.add_argument("--threads", type=_positive_int,
                    help="torch CPU threads (default: OMP_NUM_THREADS if set, else 1; "
                    "see docs/problems.md)")
    plan.set_defaults(func=_cmd_plan)

    tr = sub.add_parser("train", help="train a problem file",
                        description="Train the problem defined in PROBLEM.py; writes "
                        "RUN_DIR/log.h5 (HDF5 log, one row per iteration) and "
                        "RUN_DIR/restart.pt (restart file).")
    tr.add_argument("problem", help="problem file (problems/NAME.py)")
    tr.add_argument("--iterations", type=_positive_int, help="optimiser iterations")
    tr.add_argument("--steps", type=_positive_int, help="unroll length T")
    tr.add_argument("--budget", help="memory budget for the unroll: 2GiB, 512MB or 80%%")
    tr.add_argument("--snapshots", type=_positive_int,
                    help="revolve snapshots when no budget is given")
    tr.add_argument("--device", help="cpu, cuda or cuda:N")
    tr.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"])
    tr.add_argument("--seed", type=int)
    tr.add_argument("--lr", type=float, help="learning rate")
    tr.add_argument("--threads", type=_positive_int,
                    help="torch CPU threads (default: OMP_NUM_THREADS if set, else 1; "
                    "see docs/problems.md)")
    tr.add_argument("--out", help="run directory (default runs/<problem name>)")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any problem setting, typed by its default (repeatable)")
    tr.add_argument("--resume", action="store_true",
                    help="continue from RUN_DIR/restart.pt, appending to the log")
    tr.add_argument("--tensorboard", nargs="?", const="tensorboard", metavar="DIR",
                    help="also write the log's scalars as TensorBoard event files, in DIR "
                    "(default RUN_DIR/tensorboard; needs the [tensorboard] extra)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.add_argument("--no-file-locking", action="store_true",
                    help="open the HDF5 log without file locks (Lustre/GPFS/NFS)")
    tr.set_defaults(func=_cmd_train)

    sb = sub.add_parser("submit", help="write a SLURM batch script and submit it",
                        usage="deepsolve submit PROBLEM.py --gpus-per-node G --time HH:MM:SS "
                        "[options] [-- TRAIN ARGS]",
                        description="Write RUN_DIR/deepsolve.sbatch (srun + torchrun on every "
                        "node; requeues itself and resumes when preempted or near its time "
                        "limit) and submit it with sbatch; without sbatch, or with --dry-run, "
                        "print it. Arguments after -- go to `deepsolve train`. See docs/hpc.md.")
    sb.add_argument("problem", help="problem file (problems/NAME.py)")
    sb.add_argument("--nodes", default="1", help="nodes (default 1)")
    sb.add_argument("--gpus-per-node", help="GPUs per node, one training process each; "
                    "0 for CPU-only nodes")
    sb.add_argument("--tasks-per-node", default="1",
                    help="CPU-only nodes: training processes per node (default 1)")
    sb.add_argument("--time", help="time limit HH:MM:SS or D-HH:MM:SS")
    sb.add_argument("--partition", help="SLURM partition")
    sb.add_argument("--account", help="SLURM account")
    sb.add_argument("--cpus-per-task", help="CPUs per node for the training processes")
    sb.add_argument("--job-name", help="job name (default deepsolve-<problem name>)")
    sb.add_argument("--port", default="29500", help="rendezvous port on the first node "
                    "(default 29500)")
    sb.add_argument("--out", help="run directory (default runs/<problem name>)")
    sb.add_argument("--dry-run", action="store_true",
                    help="write and print the script, do not submit it")
    sb.set_defaults(func=_cmd_submit, train_args=[])

    ck = sub.add_parser("check", help="check a problem's gradients and recomputation",
                        description="Run the problem's unroll at a short horizon with the "
                        "schedule the run would use, with revolve and periodic schedules and "
                        "with store_all (plain autograd); compare the gradients of x0 and of "
                        "every parameter, replay each schedule to confirm that recomputation "
                        "is deterministic, and catch randomness that escapes torch's RNG. A "
                        "problem without an unroll (a PINN) gets its chunked residual gradient "
                        "compared with plain autograd. Prints the table; exit code 1 on a "
                        "mismatch. See docs/check.md.")
    ck.add_argument("problem", help="problem file (problems/NAME.py)")
    ck.add_argument("--steps", type=_positive_int,
                    help="horizon of the check (default: 20, or the run's steps if fewer)")
    ck.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any problem setting, typed by its default (repeatable)")
    ck.add_argument("--budget", help="the run's memory budget (as for train)")
    ck.add_argument("--snapshots", type=_positive_int,
                    help="the run's revolve snapshots when no budget is given")
    ck.add_argument("--device", help="cpu, cuda or cuda:N")
    ck.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"])
    ck.add_argument("--seed", type=int)
    ck.add_argument("--threads", type=_positive_int,
                    help="torch CPU threads (default: OMP_NUM_THREADS if set, else 1; "
                    "see docs/problems.md)")
    ck.add_argument("--rtol", type=_positive_float, default=None,
                    help="relative tolerance (default by dtype: 1e-9 float64, 1e-4 float32, "
                    "1e-2 16-bit)")
    ck.set_defaults(func=_cmd_check)

    st = sub.add_parser("settings", help="list a problem's settings",
                        description="Print every setting of a problem file (the trainer's and "
                        "the problem's own): its default, its range and what it does. Change "
                        "one with train --set KEY=VALUE.")
    st.add_argument("problem", help="problem file (problems/NAME.py)")
    st.set_defaults(func=_cmd_settings)

    rp = sub.add_parser("report", help="summarise a run and plot it",
                        description="Print a summary of RUN_DIR/log.h5 and write loss.png, "
                        "memory.png and time.png (and metrics.png) into RUN_DIR.")
    rp.add_argument("run_dir", help="a run directory holding log.h5")
    rp.add_argument("--out", help="where to write the PNGs (default RUN_DIR)")
    rp.add_argument("--no-file-locking", action="store_true",
                    help="open the HDF5 log without file locks (Lustre/GPFS/NFS)")
    rp.set_defaults(func=_cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line; a Ctrl-C anywhere outside the trainer's loop (argument parsing,
    imports, loading data) is one line and exit code 130. Once the exit code is decided,
    signals during the interpreter's exit leave it as it is and print no traceback
    (:func:`deepsolve._process.shutdown_signals`)."""
    from ._process import end_rank, shutdown_signals

    try:
        code = _main(argv)
    except KeyboardInterrupt:
        print("deepsolve: interrupted", file=sys.stderr)
        code = 130
    return end_rank(shutdown_signals(code))


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = None
    if argv[:1] == ["submit"] and "--" in argv:  # `submit ... -- TRAIN ARGS`
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if train_args is not None:
        args.train_args = train_args
    from .distributed.halo import HaloTimeout

    try:
        return args.func(args)
    except (ValueError, FloatingPointError, NotImplementedError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"deepsolve {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except OverflowError as e:  # e.g. --budget 1e400
        print(f"deepsolve {args.command}: error: a value is out of range ({e})",
              file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be read or written
        if e.filename is not None and e.strerror:
            msg = f"{e.filename}: {e.strerror}"
        else:
            msg = (str(e).splitlines() or [type(e).__name__])[0]
        print(f"deepsolve {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except HaloTimeout as e:  # another rank of a decomposition failed: its message says why
        print(f"deepsolve {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"deepsolve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
