"""Headless Chromium for the pages' tests (the progress page, the operator page), driven by
selenium with Debian's chromium and chromium-driver."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.pgtools import require

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextmanager
def chromium(window: str) -> Iterator[Any]:
    """A headless Chromium of window size `window` ("1000,900") with a profile of its own,
    closed afterwards; fails in CI (skips elsewhere) where it is not installed."""
    require(
        Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(),
        "chromium and chromium-driver are not installed",
    )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="thumbq-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--window-size={window}",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
