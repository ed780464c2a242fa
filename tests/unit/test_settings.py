"""Reading the configuration from the environment: what each setting accepts, the defaults a
blank value keeps, and the one line that names a setting thumbq cannot use."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engine.config import SECRET_FILE, Config, ConfigError


def read(tmp_path: Path, **env: str) -> Config:
    return Config.from_env({"THUMBQ_HOME": str(tmp_path / "home"), **env})


def refusal(tmp_path: Path, **env: str) -> str:
    with pytest.raises(ConfigError) as info:
        read(tmp_path, **env)
    message = str(info.value)
    assert "\n" not in message, "a configuration error is one line"
    return message


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        (
            "THUMBQ_BUDGET_MS",
            "ten seconds",
            "THUMBQ_BUDGET_MS must be an integer, got 'ten seconds'",
        ),
        ("THUMBQ_BUDGET_MS", "999", "THUMBQ_BUDGET_MS must be between 1000 and 900000, got 999"),
        ("THUMBQ_CONCURRENCY", "0", "THUMBQ_CONCURRENCY must be between 1 and 64, got 0"),
        ("THUMBQ_BATCH_SIZE", "10001", "THUMBQ_BATCH_SIZE must be between 1 and 10000, got 10001"),
        ("THUMBQ_MAX_ATTEMPTS", "1.5", "THUMBQ_MAX_ATTEMPTS must be an integer, got '1.5'"),
        (
            "THUMBQ_RETENTION_DAYS",
            "-1",
            "THUMBQ_RETENTION_DAYS must be between 0 and 36500, got -1",
        ),
        ("THUMBQ_THUMB_SIZES", "128,huge", "THUMBQ_THUMB_SIZES must be comma-separated integers"),
        ("THUMBQ_THUMB_SIZES", "8", "THUMBQ_THUMB_SIZES values must be between 16 and 4096, got 8"),
        ("THUMBQ_THUMB_SIZES", " , ,", "THUMBQ_THUMB_SIZES names no size"),
        ("THUMBQ_THUMB_SIZES", "16,32,48,64,80,96,112,128,144", "at most 8 sizes"),
        ("THUMBQ_THUMB_FORMAT", "gif", "THUMBQ_THUMB_FORMAT must be webp, jpeg or avif, got 'gif'"),
        ("THUMBQ_SIGNED_URL_TTL_S", "0", "THUMBQ_SIGNED_URL_TTL_S must be between 1 and 604800"),
        ("THUMBQ_SIGNED_URL_TTL_S", "604801", "THUMBQ_SIGNED_URL_TTL_S must be between 1 and"),
        ("THUMBQ_METRICS_TOKEN", "short", "THUMBQ_METRICS_TOKEN must be at least 16 characters"),
        ("SUPABASE_URL", "project.supabase.co", "SUPABASE_URL must be an http(s) URL"),
        ("DATABASE_URL", "localhost", "DATABASE_URL is not a Postgres connection string"),
    ],
)
def test_a_setting_thumbq_cannot_use_is_one_line_naming_it_and_what_it_takes(
    tmp_path: Path, name: str, value: str, says: str
) -> None:
    assert says in refusal(tmp_path, **{name: value})


def test_the_buffer_must_leave_part_of_the_budget_for_work(tmp_path: Path) -> None:
    says = "THUMBQ_BUFFER_MS must be smaller than THUMBQ_BUDGET_MS"
    assert refusal(tmp_path, THUMBQ_BUDGET_MS="3000", THUMBQ_BUFFER_MS="3000") == says
    config = read(tmp_path, THUMBQ_BUDGET_MS="3000", THUMBQ_BUFFER_MS="2999")
    assert config.deadline_ms == 1


def test_blank_settings_keep_their_defaults(tmp_path: Path) -> None:
    blank = read(
        tmp_path,
        THUMBQ_BUDGET_MS="",
        THUMBQ_BUFFER_MS=" ",
        THUMBQ_THUMB_SIZES="",
        THUMBQ_THUMB_FORMAT="",
        THUMBQ_SIGNED_URL_TTL_S="",
        DATABASE_URL="",
    )
    assert (blank.budget_ms, blank.buffer_ms, blank.deadline_ms) == (10_000, 2_000, 8_000)
    assert (blank.thumb_sizes, blank.thumb_format) == ((512,), "webp")
    assert blank.signed_url_ttl_s is None and blank.database_url is None


def test_sizes_are_sorted_without_repeats_and_jpg_means_jpeg(tmp_path: Path) -> None:
    config = read(tmp_path, THUMBQ_THUMB_SIZES="512, 128,,256,128", THUMBQ_THUMB_FORMAT="JPG")
    assert config.thumb_sizes == (128, 256, 512) and config.thumb_size == 512
    assert (config.thumb_format, config.thumb_ext) == ("jpeg", "jpg")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://thumbq:pw@db.example.com:5432/app",
        "postgres://localhost/app?sslmode=require",
        "host=/var/run/postgresql dbname=app",
    ],
)
def test_a_url_or_libpqs_key_value_form_is_a_database_url(tmp_path: Path, url: str) -> None:
    assert read(tmp_path, DATABASE_URL=url).database_url == url


def test_the_cron_secret_comes_from_the_environment_then_from_the_homes_file(
    tmp_path: Path,
) -> None:
    assert read(tmp_path).cron_secret is None
    home = tmp_path / "home"
    home.mkdir()
    (home / SECRET_FILE).write_text("a-secret-kept-in-the-home-folder\n", encoding="utf-8")
    kept = read(tmp_path)
    assert kept.cron_secret == "a-secret-kept-in-the-home-folder"
    assert kept.cron_secret_source == str(home / SECRET_FILE)
    vercel = read(tmp_path, CRON_SECRET="vercels-cron-secret")
    assert (vercel.cron_secret, vercel.cron_secret_source) == (
        "vercels-cron-secret",
        "THUMBQ_CRON_SECRET",
    )
    both = read(tmp_path, CRON_SECRET="vercels-cron-secret", THUMBQ_CRON_SECRET="thumbqs-own")
    assert both.cron_secret == "thumbqs-own"


def test_a_secret_file_cut_short_counts_as_no_secret(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / SECRET_FILE).write_text("too-short", encoding="utf-8")
    assert read(tmp_path).cron_secret is None


def test_task_modules_are_a_comma_separated_list(tmp_path: Path) -> None:
    config = read(tmp_path, THUMBQ_TASKS=" app.tasks , ,reports.export,")
    assert config.tasks == ("app.tasks", "reports.export")


@pytest.mark.parametrize(
    ("value", "debug"), [("1", True), ("TRUE", True), ("on", True), ("0", False)]
)
def test_thumbq_debug_takes_the_usual_spellings_of_yes(
    tmp_path: Path, value: str, debug: bool
) -> None:
    assert read(tmp_path, THUMBQ_DEBUG=value).debug is debug
