"""`tokenmill sim`: the seeded fault explorer over the real job code (`workers.sim`)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sim", help="explore seeded fault schedules over the real job code (no model is loaded)",
        description="Run the real job code (intake, planning, shards, sweep, broker-loss resend, finalize, cancel, "
                    "expiry) with simulated workers, time, broker and object store while seeded faults strike, "
                    "then check the invariants. Each seed replays exactly.")
    parser.add_argument("--seeds", type=int, default=200, metavar="N", help="how many seeds to run (default 200)")
    parser.add_argument("--first-seed", type=int, default=0, metavar="S", help="the first of --seeds (default 0)")
    parser.add_argument("--seed", type=int, metavar="S", help="replay this one seed, printing its fault schedule")
    parser.add_argument("--workers", type=int, default=3, metavar="K", help="simulated workers (default 3)")
    parser.add_argument("--database-url", metavar="URL",
                        help="a PostgreSQL database to run on (its tables are emptied per seed); default: SQLite")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    logging.getLogger("alembic").setLevel(logging.WARNING)  # it logs at INFO on import
    from workers.sim.explore import explore, report

    console = Console(stderr=True)
    if args.seed is not None:
        seeds = [args.seed]
    else:
        seeds = range(args.first_seed, args.first_seed + args.seeds)
    bar = Progress(TextColumn("sim"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[bad]} failing"),
                   TimeElapsedColumn(), console=console, transient=True)
    task = bar.add_task("sim", total=len(seeds), bad=0)
    failing = []

    def on_outcome(outcome) -> None:
        if not outcome.ok:
            failing.append(outcome)
        bar.update(task, advance=1, bad=len(failing))

    with bar:
        summary = explore(seeds, args.workers, args.database_url, on_outcome)
    for outcome in summary.failures:
        print(report(outcome, args.workers, args.database_url))
    if args.seed is not None and not summary.failures:
        print(report(summary.last, args.workers, args.database_url))
    print(summary.line())
    return 1 if summary.failures else 0
