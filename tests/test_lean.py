"""A lean deployment (issue 21, item 6): a library the install lacks is named where it is
needed, never a traceback.

The missing libraries are real: each test runs the installed `thumbq` in a subprocess whose
`sitecustomize` makes importing the named modules fail as it does where they are not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.corpus import a4_pdf, small_jpeg
from tests import formats_corpus as fc
from tests.clirun import thumbq, user_env
from worker.config import Config
from worker.jobs import TERMINAL
from worker.render import heif
from worker.storage import open_storage

ROOT = Path(__file__).resolve().parent.parent


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
        if all(job["status"] in TERMINAL for job in jobs.values()):
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
