"""Square thumbnails (THUMBQ_THUMB_FIT=cover) and a document's first pages (THUMBQ_PAGES)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.liveapp import call
from tests.support.pgtools import require
from tests.system import test_progress_page
from tests.unit.test_crops import SIZES, _decode, _is_red, _pdf
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.local.server import ServerThread
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.render import RenderOptions, render
from worker.thumbnails.render.process import RenderPool
from worker.thumbnails.task import render_options, thumbnail_key

# The progress page's tests' headless Chromium, as a fixture of this module.
chromium = test_progress_page.browser
SECRET = "crop-pages-secret-0123456789abcdef"


# -- cover -----------------------------------------------------------------------------------------


# -- pages -----------------------------------------------------------------------------------------


def _batch_config(tmp_path: Path, db_url: str, **extra: str) -> Config:
    return Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "1",
            "THUMBQ_THUMB_SIZES": ",".join(map(str, SIZES)),
            "THUMBQ_CRON_SECRET": SECRET,
            **extra,
        }
    )


def _run(config: Config, db_url: str, files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    storage = open_storage(config)
    for key, data in files.items():
        storage.put(key, data, "application/pdf")
    with (
        db.connect(db_url) as conn,
        RenderPool(render_options(config), 1, config.render_memory_mb) as pool,
    ):
        enqueue_keys(conn, storage, config, [{"source_key": k} for k in files], "docs")
        for _ in range(5):
            run_batch(config, conn, storage, pool)
            p = Queue(conn).progress("docs") or {}
            if p.get("pending", 0) + p.get("processing", 0) == 0:
                break
        return {r["source_key"]: r for r in conn.execute("select * from thumbq.jobs")}


def test_pages_1_to_n_are_stored_and_listed_in_order_and_page_1_keeps_its_key(
    tmp_path: Path, db_url: str
) -> None:
    config = _batch_config(tmp_path, db_url, THUMBQ_PAGES="5")
    jobs = _run(config, db_url, {"docs/report.pdf": _pdf(3), "docs/memo.pdf": _pdf(1)})
    storage = open_storage(config)

    report = jobs["docs/report.pdf"]
    assert report["status"] == "completed", report["last_error"]
    etag = report["source_etag"]

    def keys(page: int | None) -> dict[str, str]:
        return {str(s): thumbnail_key("docs/report.pdf", etag, s, "webp", page) for s in SIZES}

    # Page 1 keeps today's keys; pages 2 and 3 (all the document has of the 5 asked) add theirs.
    assert keys(None)["512"] == f"thumbnails/docs/report.pdf/{etag}-512.webp"
    assert keys(2)["512"] == f"thumbnails/docs/report.pdf/{etag}-p2-512.webp"
    assert report["thumbnail_key"] == keys(None)["512"]
    assert report["thumbnails"] == {
        **keys(None),
        "pages": [
            {"page": 1, "thumbnails": keys(None)},
            {"page": 2, "thumbnails": keys(2)},
            {"page": 3, "thumbnails": keys(3)},
        ],
    }
    # Each page's picture is that page: compare the stored page 2 with a render of page 2 alone.
    alone = render(_pdf(3), None, RenderOptions(sizes=SIZES, pdf_page=2))
    stored, _ = storage.get(keys(2)["512"])
    assert stored == alone.renditions[-1].data
    first, _ = storage.get(keys(None)["512"])
    assert first != stored

    # A one-page document: today's shape, no list.
    memo = jobs["docs/memo.pdf"]
    assert set(memo["thumbnails"]) == {"128", "256", "512"}

    # The API's answer: `thumbnails` keeps page 1's {size: key}; `pages` lists every page.
    from api import create_app

    app = create_app(config)
    server = ServerThread(app).start()
    try:
        status, body, _ = call("GET", f"{server.url}/api/thumbnails/jobs/{report['id']}", SECRET)
        assert status == 200 and body is not None
        assert body["thumbnails"] == keys(None)
        assert [p["page"] for p in body["pages"]] == [1, 2, 3]
        assert body["pages"][1]["thumbnails"] == keys(2)
        status, body, _ = call("GET", f"{server.url}/api/thumbnails/jobs/{memo['id']}", SECRET)
        assert status == 200 and body is not None
        assert body["pages"] == [{"page": 1, "thumbnails": memo["thumbnails"]}]
        # The gallery hands the page an URL for each page of the report.
        status, body, _ = call("GET", f"{server.url}/api/thumbnails/gallery?group_id=docs", SECRET)
        assert status == 200 and body is not None
        items = {i["source_key"]: i for i in body["thumbnails"]}
        assert [p["page"] for p in items["docs/report.pdf"]["pages"]] == [1, 2, 3]
        assert items["docs/memo.pdf"]["pages"] == []
        status, _, headers = call("GET", server.url + items["docs/report.pdf"]["pages"][2]["url"])
        assert status == 200 and headers["Content-Type"] == "image/webp"
    finally:
        server.close()
        app.extensions["thumbq"].close()


def test_one_page_is_the_default_and_keeps_todays_keys(tmp_path: Path, db_url: str) -> None:
    config = _batch_config(tmp_path, db_url)
    jobs = _run(config, db_url, {"docs/report.pdf": _pdf(3)})
    job = jobs["docs/report.pdf"]
    etag = job["source_etag"]
    assert job["thumbnails"] == {
        str(s): thumbnail_key("docs/report.pdf", etag, s, "webp") for s in SIZES
    }
    files = sorted(p.name for p in (tmp_path / "storage" / "thumbnails" / "docs").rglob("*.webp"))
    assert files == sorted(f"{etag}-{s}.webp" for s in SIZES)


def test_a_decks_slides_through_libreoffice_are_its_pages() -> None:
    from tests.support import formats_corpus as fc
    from worker.thumbnails.render.office import find_soffice

    soffice = find_soffice()
    require(soffice is not None, "LibreOffice (soffice) is not installed")
    opts = RenderOptions(sizes=SIZES, pages=5, soffice=soffice)
    with RenderPool(opts, 1, 1024) as pool:
        thumb = pool.render(fc.pptx_deck(), None, timeout_s=60)
    # Three slides of the five asked: each slide at every size, in order, the first slide's red
    # rectangle on page 1 only.
    assert [(r.page, r.size) for r in thumb.renditions] == [
        (p, s) for p in (1, 2, 3) for s in SIZES
    ]
    reds = []
    for r in thumb.renditions[2::3]:
        img = _decode(r.data)
        reds.append(
            sum(
                _is_red(img.getpixel((x, y)))
                for x in range(0, img.width, 8)
                for y in range(0, img.height, 8)
            )
        )
    assert reds[0] > 100 and reds[1] == reds[2] == 0


def test_the_progress_page_shows_a_documents_pages_in_order(
    chromium: Any, tmp_path: Path, db_url: str
) -> None:
    from selenium.webdriver.common.by import By

    from tests.support.liveapp import wait_until

    config = _batch_config(tmp_path, db_url, THUMBQ_PAGES="3")
    jobs = _run(config, db_url, {"docs/report.pdf": _pdf(4), "docs/memo.pdf": _pdf(1)})
    assert {j["status"] for j in jobs.values()} == {"completed"}
    from api import create_app

    app = create_app(config)
    server = ServerThread(app).start()
    try:
        chromium.get(f"{server.url}/progress?group_id=docs#key={SECRET}")
        wait_until(lambda: len(chromium.find_elements(By.CSS_SELECTOR, "#grid > li")) == 2, 20)
        report = chromium.find_element(
            By.CSS_SELECTOR, f"#grid > li[data-job='{jobs['docs/report.pdf']['id']}']"
        )
        memo = chromium.find_element(
            By.CSS_SELECTOR, f"#grid > li[data-job='{jobs['docs/memo.pdf']['id']}']"
        )
        pages = report.find_elements(By.CSS_SELECTOR, ".pages img")
        assert [p.get_attribute("alt") for p in pages] == ["page 1", "page 2", "page 3"]
        assert memo.find_elements(By.CSS_SELECTOR, ".pages") == []
        loaded = wait_until(
            lambda: chromium.execute_script(
                "return [...document.querySelectorAll('#grid .pages img')]"
                ".every(i => i.complete && i.naturalWidth > 0)"
            ),
            15,
        )
        assert loaded
    finally:
        server.close()
        app.extensions["thumbq"].close()
