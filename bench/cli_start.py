"""Cold start of the `thumbq` command: what a person waits for before a command does anything.

Two figures per command line, medians of several fresh processes: the whole process
(`python -m worker.cli ARGS`, spawn to exit, wall and CPU time), and the CLI's own part in a
child that has already imported what the CLI imports at its top (psycopg, the config, ...):
importing `worker.cli` and parsing the arguments, in process time, which the load of a shared
machine disturbs least. No database is used: every command line here ends in the parser.

    .venv/bin/python -m bench.cli_start [--runs 15] [--against OLD_CHECKOUT]

`--against` measures another source tree (e.g. `git worktree add /tmp/old <commit>`) interleaved
with this one, so that both see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import median, write_result

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (["--help"], ["status", "--help"], ["jobs", "enqueue", "--help"], ["--version"])

# The CLI's own part: its dependencies first (what worker/cli imported at its top before it was
# a package), then the clock, then `worker.cli` and the parse that `thumbq ARGS` makes.
CHILD = """
import contextlib, io, json, sys, time
import argparse, threading, datetime, pathlib, importlib.metadata
from worker.engine import db, stopping, config, queue
from worker.app import validation, signing
from worker.local import terminal
c0 = time.process_time()
import worker.cli
try:
    from worker.cli.parser import parse
except ImportError:  # a tree from before the CLI was a package
    parse = lambda argv: worker.cli.build_parser().parse_args(argv)
with contextlib.redirect_stdout(io.StringIO()):
    try:
        parse(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps({"cli_cpu_ms": (time.process_time() - c0) * 1000}))
"""


def _whole(tree: Path, argv: list[str]) -> tuple[float, float]:
    """Wall and CPU time (ms) of `python -m worker.cli ARGV` run in `tree` (`-m` and `-c` put
    the current directory first on the path: the tree measured is the one run in)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", *argv], env=env, cwd=tree, stdout=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = (time.perf_counter() - t) * 1000
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"thumbq {' '.join(argv)} failed in {tree}")
    return wall, (usage.ru_utime + usage.ru_stime) * 1000


def _own(tree: Path, argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *argv],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["cli_cpu_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--against", type=Path, default=None, help="another tree to measure")
    args = parser.parse_args()

    trees = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    for tree in trees.values():  # compiled once, as an installed wheel is
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "worker"],
            cwd=tree,
            check=True,
            capture_output=True,
        )
    load_before = os.getloadavg()[0]
    runs: dict[tuple[str, str], dict[str, list[float]]] = {}
    for i in range(args.runs):
        for argv in COMMANDS:
            # Alternate which tree goes first, so neither always runs on a warmer cache.
            order = list(trees.items()) if i % 2 else list(trees.items())[::-1]
            for name, tree in order:
                r = runs.setdefault((name, " ".join(argv)), {"wall": [], "cpu": [], "own": []})
                wall, cpu = _whole(tree, argv)
                r["wall"].append(wall)
                r["cpu"].append(cpu)
                r["own"].append(_own(tree, argv))
    result: dict[str, Any] = {
        "method": "per command line, medians of fresh processes: whole = `python -m "
        "worker.cli ARGS` spawn to exit (wall, and CPU from wait4); cli_own_cpu = process time "
        "of importing worker.cli and parsing ARGS in a child that imported the CLI's "
        "dependencies first; worker/ precompiled",
        "runs": args.runs,
        "trees": {name: str(tree) for name, tree in trees.items()},
    }
    for (name, line), r in runs.items():
        result.setdefault(name, {})[f"thumbq {line}"] = {
            "whole_wall_ms_median": round(median(r["wall"]), 1),
            "whole_wall_ms_min": round(min(r["wall"]), 1),
            "whole_cpu_ms_median": round(median(r["cpu"]), 1),
            "cli_own_cpu_ms_median": round(median(r["own"]), 2),
        }
    # Other work on the machine inflates every figure: say how busy it was.
    result["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    write_result("cli_start", result)


if __name__ == "__main__":
    main()
