"""Where pgserver has no wheel (Linux aarch64, musl), thumbq installs without it and says
what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Loaded at start-up (sitecustomize): `import pgserver` fails as it does where it is not installed.
_NO_PGSERVER = """
import sys

class _NoPgserver:
    def find_spec(self, name, path=None, target=None):
        if name == "pgserver" or name.startswith("pgserver."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoPgserver())
"""


def test_pgserver_is_only_a_dependency_where_it_has_wheels() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The `local` extra (the README's install), not the serverless function's set.
    local = project["optional-dependencies"]["local"]
    (pg,) = [d for d in local if d.startswith("pgserver")]
    from packaging.markers import Marker

    marker = Marker(pg.split(";", 1)[1])
    env = {"sys_platform": "linux", "platform_machine": "x86_64"}
    assert marker.evaluate(env)
    assert marker.evaluate({"sys_platform": "darwin", "platform_machine": "arm64"})
    assert marker.evaluate({"sys_platform": "darwin", "platform_machine": "x86_64"})
    assert not marker.evaluate({**env, "platform_machine": "aarch64"})


@pytest.mark.parametrize("command", [["up", "--port", "0"], ["status"], ["run-batch"]])
def test_without_pgserver_or_database_url_the_cli_says_to_set_database_url(
    tmp_path: Path, command: list[str]
) -> None:
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(_NO_PGSERVER)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "TEST_DATABASE_URL") and not k.startswith("THUMBQ_")
    }
    env["THUMBQ_HOME"] = str(tmp_path / "home")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "shim"), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", *command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("thumbq: ") and "set DATABASE_URL" in lines[0]
    assert "pgserver" in lines[0] and "Traceback" not in proc.stderr
