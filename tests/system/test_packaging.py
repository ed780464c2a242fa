"""What `pip install thumbq` brings (issue 10, point 13): every module thumbq imports is a
declared dependency, one HTTP server is required and the other optional, and the README says
what PyMuPDF's licence means for a user."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from tests.support.clirun import thumbq_exe, user_env
from tests.support.liveapp import call, wait_listening
from tests.support.pgbouncer import free_port

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Imported only where they exist, each behind a check that says what to install or set:
# LibreOffice's own Python bridge, and type stubs read by mypy alone.
NOT_FROM_PYPI = {"uno", "com", "mypy_boto3_s3"}
# Parts of a declared package's own API, shipped as its dependency.
COMES_WITH = {"botocore": "boto3", "werkzeug": "flask"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    hard = {_name(r) for r in PYPROJECT["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in PYPROJECT["optional-dependencies"].items()}
    return hard, extras


def _imported_modules() -> set[str]:
    """Top-level modules that api/ and worker/ import, lazily or not."""
    found: set[str] = set()
    for path in [*ROOT.joinpath("api").rglob("*.py"), *ROOT.joinpath("worker").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"api", "worker", "__future__"}


def test_every_module_thumbq_imports_is_a_declared_dependency() -> None:
    # Regression: api/state.py imports psycopg_pool, which nothing declared (it came along
    # with another package by chance).
    hard, extras = _declared()
    runtime_extras = set().union(*(v for k, v in extras.items() if k != "test"))
    providers = packages_distributions()
    for module in sorted(_imported_modules() - NOT_FROM_PYPI):
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        assert dists, f"{module} is imported but no installed distribution provides it"
        if module in COMES_WITH:
            dists = {COMES_WITH[module]}
        assert dists & (hard | runtime_extras), f"{module} ({dists}) is not declared"


def test_one_http_server_is_required_and_the_other_is_an_extra() -> None:
    # Regression: waitress and granian were both hard dependencies.
    hard, extras = _declared()
    assert "waitress" in hard and "granian" not in hard
    assert "granian" in extras["granian"]
    assert "psycopg-pool" in hard


_NO_GRANIAN = """
import sys

class _NoGranian:
    def find_spec(self, name, path=None, target=None):
        if name == "granian" or name.startswith("granian."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoGranian())
"""


def test_serve_without_the_granian_extra_serves_with_waitress(tmp_path: Path, db_url: str) -> None:
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(_NO_GRANIAN)
    port = free_port()
    env = user_env(
        tmp_path,
        DATABASE_URL=db_url,
        THUMBQ_CRON_SECRET="serve-secret-0123456789",
        PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), str(ROOT)]),
    )
    proc = subprocess.Popen(
        [thumbq_exe(), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_listening(proc, port)
        assert call("GET", f"http://127.0.0.1:{port}/healthz", timeout=5)[0] == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "with waitress" in err and "Traceback" not in err
    refused = subprocess.run(
        [thumbq_exe(), "serve", "--server", "granian"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "pip install 'thumbq[granian]'" in refused.stderr


def test_the_readme_says_pymupdf_is_agpl_and_what_that_means() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    licence = readme[readme.index("## Licence") :]
    assert "PyMuPDF" in licence and "AGPL-3.0" in licence
    assert "network" in licence and "source" in licence  # what the AGPL asks of a service
    assert "commercial" in licence  # and the way out
