"""Command line: ``python -m deepsolve <command> ...``. Argument parsing only."""

from __future__ import annotations

import argparse
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


def _cmd_plan(args: argparse.Namespace) -> int:
    from . import schedules as S
    from .schedules.diagram import png_diagram, summary, text_diagram

    if args.steps is None:
        raise SystemExit("deepsolve plan: give --steps N (and --snapshots S)")
    if args.schedule == "revolve":
        if args.snapshots is None:
            raise SystemExit("deepsolve plan: revolve needs --snapshots S (S >= 1)")
        sched = S.revolve(args.steps, args.snapshots)
    elif args.schedule == "periodic":
        sched = S.periodic(args.steps, args.every)
    else:
        sched = S.store_all(args.steps)
    print(summary(sched))
    if args.show:
        print()
        print(text_diagram(sched))
    if args.png:
        png_diagram(sched, args.png)
        print(f"diagram written to {args.png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepsolve",
        description="Train through long iterative computations with checkpointed, "
        "memory-bounded exact gradients.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    plan = sub.add_parser("plan", help="show a checkpoint schedule and its cost",
                          description="Show a checkpoint schedule: its cost (advances, "
                          "recompute factor, peak slots) and, with --show, its diagram.")
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
    plan.set_defaults(func=_cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"deepsolve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
