"""What a deployment installs, unzipped: the serverless function's set against the local one.

Each set is installed the way a serverless build installs it: a fresh virtual environment's pip,
`pip install --target DIR <checkout>[extras]`, into an empty folder (no pip or setuptools of the
venv's own counted), with pip's defaults (bytecode compiled: the larger, honest figure). The
total is every file's size under that folder (`du -sb`); each distribution's is the sum of the
files its RECORD lists.

    .venv/bin/python -m bench.bundle [--set function --set local] [--keep DIR]

- `function`: `pip install .`, the project's own dependencies: what Vercel's Python runtime
  installs from pyproject.toml, and what an AWS Lambda zip holds;
- `local`: `pip install '.[local]'`, the README's command: the embedded Postgres and video too.

AWS Lambda refuses a function whose unzipped code and layers exceed 250 MiB; Vercel allows a
Python function 500 MB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

from bench.common import write_result

ROOT = Path(__file__).resolve().parent.parent
LAMBDA_LIMIT_BYTES = 250 * 1024 * 1024
SETS = {"function": "", "local": "[local]"}


def tree_bytes(folder: Path) -> int:
    """Every regular file's size under `folder`, symlinks not followed (`du -sb`, less the
    folders' own blocks)."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                total += os.path.getsize(path)
    return total


def by_distribution(target: Path) -> list[dict[str, Any]]:
    """Each installed distribution's name, version and bytes on disk, largest first."""
    rows = []
    for dist in distributions(path=[str(target)]):
        size = 0
        for file in dist.files or ():
            path = target / file
            if path.is_file() and not path.is_symlink():
                size += path.stat().st_size
        rows.append({"name": dist.metadata["Name"], "version": dist.version, "bytes": size})
    return sorted(rows, key=lambda r: -r["bytes"])


def measure(name: str, work: Path) -> dict[str, Any]:
    """Install set `name` into a fresh folder and measure it."""
    venv = work / f"venv-{name}"
    target = work / f"site-{name}"
    shutil.rmtree(venv, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    spec = f"{ROOT}{SETS[name]}"
    started = time.monotonic()
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--target", str(target), spec],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    install_s = time.monotonic() - started
    total = tree_bytes(target)
    dists = by_distribution(target)
    return {
        "install": f"pip install --target DIR '{spec.replace(str(ROOT), '.')}'",
        "install_s": round(install_s, 1),
        "total_bytes": total,
        "total_mib": round(total / 2**20, 1),
        "fits_lambda_250_mib": total < LAMBDA_LIMIT_BYTES,
        "distributions": [{**d, "mib": round(d["bytes"] / 2**20, 2)} for d in dists],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", choices=sorted(SETS), dest="sets")
    parser.add_argument("--keep", type=Path, help="install here and keep it (default: a temp dir)")
    args = parser.parse_args()
    sets = args.sets or list(SETS)
    work = args.keep or Path(tempfile.mkdtemp(prefix="thumbq-bundle-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = {name: measure(name, work) for name in sets}
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    write_result(
        "bundle",
        {
            "method": "a fresh venv's pip installs each set with --target into an empty folder "
            "(bytecode compiled, pip's default); total = every file's bytes there (du -sb); "
            "per distribution = the files its RECORD lists",
            "lambda_limit_bytes": LAMBDA_LIMIT_BYTES,
            "sets": results,
        },
    )


if __name__ == "__main__":
    main()
