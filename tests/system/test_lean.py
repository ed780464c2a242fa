"""A lean deployment (issue 21, item 6): the serverless function installs the project's own
dependencies, measured under AWS Lambda's 250 MiB by bench/bundle.py, while the README's
`pip install '.[local]'` brings everything; a library the install lacks is named where it is
needed, never a traceback.

The missing libraries are real: each test runs the installed `thumbq` in a subprocess whose
`sitecustomize` makes importing the named modules fail as it does where they are not installed.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tomllib
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from bench.corpus import a4_pdf, small_jpeg
from tests.support import formats_corpus as fc
from tests.support.clirun import thumbq, user_env
from worker.engine.config import Config
from worker.engine.states import FINAL_STATUSES
from worker.storage import open_storage
from worker.thumbnails.render import heif

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
BUNDLE = json.loads((ROOT / "bench" / "results" / "bundle.json").read_text())
LAMBDA_LIMIT = 250 * 1024 * 1024


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` pull in on this machine, transitively (thumbq's own
    extras read from pyproject.toml, the others' requirements from their installed metadata)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, frozenset[str]()) for r in requirements]
    while todo:
        text, asked = todo.pop()
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in asked or {""}):
            continue
        name, extras = _key(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name == "thumbq":
            todo += [(r, frozenset[str]()) for r in _extra(req.extras)]
        else:
            todo += [(r, extras) for r in distribution(req.name).requires or ()]
    return {name for name, _ in seen} - {"thumbq"}


def _extra(names: set[str] | list[str]) -> list[str]:
    return [r for n in names for r in PYPROJECT["optional-dependencies"][n]]


def test_the_functions_install_is_measured_under_lambdas_limit_and_the_measure_is_current() -> None:
    function = BUNDLE["sets"]["function"]
    assert function["total_bytes"] < LAMBDA_LIMIT, function["total_mib"]
    measured = {_key(d["name"]) for d in function["distributions"]} - {"thumbq"}
    # What bench/bundle.py installed is what pyproject.toml's dependencies pull in today: a
    # dependency added since the measurement makes this fail until bench/bundle.py runs again.
    assert measured == _closure(PYPROJECT["dependencies"])
    assert not {"av", "pgserver"} & measured


def test_the_readmes_install_command_brings_what_the_function_leaves_out() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install '.[local]' && thumbq up" in readme
    local = _closure(_extra({"local"}))
    assert {"av", "pgserver", "pyspng"} <= local
    # The tests run on the README's local install, and the `local` set was measured too.
    assert {"av", "pgserver"} <= _closure(_extra({"test"}))
    measured = {_key(d["name"]) for d in BUNDLE["sets"]["local"]["distributions"]}
    assert {"av", "pgserver"} <= measured


# Loaded at start-up: importing any of THUMBQ_BLOCK's modules fails as where it is not installed.
_BLOCK = """
import os, sys

_blocked = set(os.environ["THUMBQ_BLOCK"].split(","))

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def _run(tmp_path: Path, db_url: str, blocked: str, files: dict[str, bytes]) -> dict[str, Any]:
    """Each file enqueued and rendered by the installed `thumbq` with `blocked` not importable;
    its job by key."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_BLOCK)
    storage_url = (tmp_path / "storage").as_uri()
    env = user_env(
        tmp_path,
        DATABASE_URL=db_url,
        THUMBQ_STORAGE_URL=storage_url,
        THUMBQ_BLOCK=blocked,
        PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]),
    )
    storage = open_storage(Config.from_env({"THUMBQ_STORAGE_URL": storage_url}))
    ids = {}
    for key, data in files.items():
        storage.put(key, data, "application/octet-stream")
        payload = json.dumps({"source_key": key})
        ids[key] = _ok(thumbq("jobs", "enqueue", "thumbnail", "--payload", payload, env=env))
    jobs: dict[str, Any] = {}
    for _ in range(5):  # a batch stops at its budget; on a loaded machine one may not do all
        _ok(thumbq("run-batch", env=env))
        jobs = {k: _ok(thumbq("jobs", "show", str(v["job_id"]), env=env)) for k, v in ids.items()}
        if all(job["status"] in FINAL_STATUSES for job in jobs.values()):
            break
    return jobs


def _ok(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def _unsupported_naming(job: dict[str, Any], *words: str) -> None:
    assert job["status"] == "unsupported", job
    assert job["error_code"] == "unsupported_type", job
    assert "Traceback" not in job["last_error"] and "No module named" not in job["last_error"]
    for word in words:
        assert word in job["last_error"], job["last_error"]


def test_a_video_without_pyav_is_unsupported_naming_the_video_extra(
    tmp_path: Path, db_url: str
) -> None:
    # Regression: the job failed as corrupt_input, "ModuleNotFoundError: No module named 'av'".
    jobs = _run(tmp_path, db_url, "av", {"v.mp4": fc.mp4_video(), "p.jpg": small_jpeg()})
    _unsupported_naming(jobs["v.mp4"], "av (PyAV", "pip install 'thumbq[video]'")
    assert jobs["p.jpg"]["status"] == "completed", jobs["p.jpg"]


def test_a_heic_photo_without_pyav_still_renders_through_libheif(
    tmp_path: Path, db_url: str
) -> None:
    photo = fc.heic_photo()
    heif.parse(photo)  # a shape FFmpeg's path takes when PyAV is there
    jobs = _run(tmp_path, db_url, "av", {"h.heic": photo})
    assert jobs["h.heic"]["status"] == "completed", jobs["h.heic"]


def test_a_png_without_libspng_still_renders_through_pillow(tmp_path: Path, db_url: str) -> None:
    # The function's set has no pyspng (its numpy is 68 MiB): Pillow decodes the PNG.
    from bench.corpus import photo_image

    screenshot, with_alpha = io.BytesIO(), io.BytesIO()
    photo_image(1280, 720, seed=7).save(screenshot, "PNG")
    photo_image(800, 600, seed=8).convert("RGBA").save(with_alpha, "PNG")
    files = {"s.png": screenshot.getvalue(), "a.png": with_alpha.getvalue()}
    jobs = _run(tmp_path, db_url, "pyspng,numpy", files)
    for key in files:
        assert jobs[key]["status"] == "completed", jobs[key]


def test_a_heic_photo_without_any_heic_decoder_is_unsupported_naming_pillow_heif(
    tmp_path: Path, db_url: str
) -> None:
    jobs = _run(tmp_path, db_url, "av,pillow_heif", {"h.heic": fc.heic_photo()})
    _unsupported_naming(jobs["h.heic"], "pillow-heif", "pip install pillow-heif")


def test_an_svg_without_resvg_is_unsupported_naming_resvg_py(tmp_path: Path, db_url: str) -> None:
    jobs = _run(tmp_path, db_url, "resvg_py", {"d.svg": fc.svg_drawing()})
    _unsupported_naming(jobs["d.svg"], "resvg-py", "pip install resvg-py")


def test_a_pdf_without_pymupdf_is_unsupported_and_pictures_still_render(
    tmp_path: Path, db_url: str
) -> None:
    # Regression: the render processes imported PyMuPDF on start, so without it no file at
    # all could be rendered.
    jobs = _run(tmp_path, db_url, "pymupdf,fitz", {"a.pdf": a4_pdf(), "p.jpg": small_jpeg()})
    _unsupported_naming(jobs["a.pdf"], "pymupdf-lite", "pip install pymupdf-lite")
    assert jobs["p.jpg"]["status"] == "completed", jobs["p.jpg"]


@pytest.mark.parametrize("command", [["up", "--port", "0"], ["status"]])
def test_without_the_embedded_postgres_one_line_names_the_local_extra_and_database_url(
    tmp_path: Path, command: list[str]
) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_BLOCK)
    env = user_env(
        tmp_path,
        THUMBQ_HOME=str(tmp_path / "home"),
        THUMBQ_BLOCK="pgserver",
        PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]),
    )
    proc = thumbq(*command, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pip install 'thumbq[local]'" in lines[0] and "set DATABASE_URL" in lines[0]
