"""New uploads to Supabase Storage enqueue themselves (sql/functions/75_storage_trigger.sql).

Supabase Storage keeps one row per object in `storage.objects`; these tests build that table
as Supabase's storage migrations define it (columns, generated path_tokens, the unique name
per bucket, RLS) in plain Postgres, upload as the `authenticated` role the way Storage writes
for a signed-in user, and check thumbq's jobs.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.support.pgtools import supabase_roles
from worker.engine import db

# storage.objects as Supabase's storage service creates it (migrations/tenant of its repository:
# 0002 storage-schema, 0002 pathtoken-column, 0014 add-version, 0017 owner_id, 0025 custom
# metadata, 0026 level), with what Storage writes in `metadata` on an upload.
STORAGE_SCHEMA = """
create schema storage;
create table storage.buckets (
  id text primary key, name text not null, owner uuid, created_at timestamptz default now(),
  updated_at timestamptz default now(), public boolean default false
);
create table storage.objects (
  id uuid not null default gen_random_uuid() primary key,
  bucket_id text references storage.buckets (id),
  name text,
  owner uuid,
  created_at timestamptz default now(),
  updated_at timestamptz default now(),
  last_accessed_at timestamptz default now(),
  metadata jsonb,
  path_tokens text[] generated always as (string_to_array(name, '/')) stored,
  version text,
  owner_id text,
  user_metadata jsonb,
  level int
);
create unique index bucketid_objname on storage.objects (bucket_id, name);
alter table storage.objects enable row level security;
grant usage on schema storage to authenticated;
grant all on storage.objects to authenticated;
create policy uploads on storage.objects for all to authenticated using (true) with check (true);
insert into storage.buckets (id, name) values ('media', 'media'), ('other', 'other');
"""


def _metadata(etag: str, size: int = 1234, mimetype: str = "image/jpeg") -> str:
    return json.dumps(
        {
            "eTag": f'"{etag}"',
            "size": size,
            "mimetype": mimetype,
            "cacheControl": "max-age=3600",
            "lastModified": "2026-01-01T00:00:00.000Z",
            "contentLength": size,
            "httpStatusCode": 200,
        }
    )


def upload(
    conn: db.Conn, name: str, etag: str, bucket: str = "media", *, commit: bool = True
) -> None:
    """What Storage does for a signed-in user's upload (or upsert): one statement as
    `authenticated`, in its own transaction."""
    tx = conn.transaction()
    tx.__enter__()
    conn.execute("set local role authenticated")
    conn.execute(
        "insert into storage.objects (bucket_id, name, owner, owner_id, metadata, version)"
        " values (%s, %s, %s, %s, %s, %s)"
        " on conflict (bucket_id, name) do update"
        " set metadata = excluded.metadata, version = excluded.version, updated_at = now()",
        [bucket, name, uuid.uuid4(), "user-1", _metadata(etag), str(uuid.uuid4())],
    )
    if commit:
        tx.__exit__(None, None, None)
    else:
        tx.__exit__(RuntimeError, RuntimeError("rolled back"), None)


def jobs(conn: db.Conn) -> list[dict[str, Any]]:
    return conn.execute(
        "select source_key, source_etag, status, error_code, group_id, content_type,"
        " source_bytes from thumbq.jobs order by id"
    ).fetchall()


def pending(conn: db.Conn) -> set[tuple[str, str]]:
    rows = conn.execute(
        "select source_key, source_etag from thumbq.jobs where status = 'pending'"
    ).fetchall()
    return {(r["source_key"], r["source_etag"]) for r in rows}


@pytest.fixture
def sconn(conn: db.Conn) -> Iterator[db.Conn]:
    """The test's database with a Supabase-shaped storage schema, watching media/uploads/."""
    supabase_roles(conn)
    conn.execute(STORAGE_SCHEMA.encode())
    conn.execute("select thumbq.watch_storage('media', 'uploads/')")
    yield conn


def test_an_upload_enqueues_its_version_in_the_uploads_own_transaction(sconn: db.Conn) -> None:
    with sconn.transaction():
        sconn.execute("set local role authenticated")
        sconn.execute(
            "insert into storage.objects (bucket_id, name, metadata) values ('media', %s, %s)",
            ["uploads/cat.jpg", _metadata("abc123", 5000, "image/jpeg")],
        )
        sconn.execute("reset role")
        # In the upload's own transaction, before it commits:
        assert pending(sconn) == {("uploads/cat.jpg", "abc123")}
    assert jobs(sconn) == [
        {
            "source_key": "uploads/cat.jpg",
            "source_etag": "abc123",  # as S3 answers HEAD, without the quotes
            "status": "pending",
            "error_code": None,
            "group_id": "uploads",
            "content_type": "image/jpeg",
            "source_bytes": 5000,
        }
    ]
    queued = sconn.execute("select queue_length from pgmq.metrics('thumbq_jobs')").fetchone()
    assert queued == {"queue_length": 1}
    # An upload that rolls back leaves no job.
    upload(sconn, "uploads/dog.jpg", "d1", commit=False)
    assert [j["source_key"] for j in jobs(sconn)] == ["uploads/cat.jpg"]


def test_an_upsert_supersedes_the_old_version_and_other_updates_change_nothing(
    sconn: db.Conn,
) -> None:
    upload(sconn, "uploads/a.png", "v1")
    upload(sconn, "uploads/a.png", "v2")  # the same name uploaded again (x-upsert)
    assert [(j["source_etag"], j["status"], j["error_code"]) for j in jobs(sconn)] == [
        ("v1", "cancelled", "superseded"),
        ("v2", "pending", None),
    ]
    # Storage touching the row for other reasons (downloads update last_accessed_at).
    sconn.execute("update storage.objects set last_accessed_at = now(), user_metadata = '{}'")
    assert len(jobs(sconn)) == 2


def test_removing_or_moving_an_object_cancels_its_waiting_job(sconn: db.Conn) -> None:
    upload(sconn, "uploads/gone.pdf", "g1")
    upload(sconn, "uploads/moved.pdf", "m1")
    upload(sconn, "uploads/busy.pdf", "b1")
    sconn.execute("update thumbq.jobs set status = 'processing' where source_key like '%busy%'")
    with sconn.transaction():
        sconn.execute("set local role authenticated")
        sconn.execute(
            "delete from storage.objects where name in ('uploads/gone.pdf', 'uploads/busy.pdf')"
        )
        sconn.execute(
            "update storage.objects set name = 'uploads/new/moved.pdf'"
            " where name = 'uploads/moved.pdf'"
        )
    by_key = {(j["source_key"], j["status"], j["error_code"]) for j in jobs(sconn)}
    assert by_key == {
        ("uploads/gone.pdf", "cancelled", "source_missing"),
        ("uploads/moved.pdf", "cancelled", "source_missing"),
        ("uploads/new/moved.pdf", "pending", None),
        # Already being rendered: the batch finds the object gone (source_missing) itself.
        ("uploads/busy.pdf", "processing", None),
    }
    msgs = sconn.execute("select count(*) as n from pgmq.q_thumbq_jobs").fetchone()
    assert msgs == {"n": 2}, "a cancelled job's message is deleted with it"


def test_only_watched_buckets_and_prefixes_and_never_thumbnails_or_placeholders(
    sconn: db.Conn,
) -> None:
    sconn.execute(
        "select thumbq.watch_storage('media', 'site/', p_key_prefix => 'site/',"
        " p_group_id => 'site', p_max_attempts => 5)"
    )
    for name, bucket in [
        ("uploads/yes.jpg", "media"),
        ("elsewhere/no.jpg", "media"),
        ("uploads/no-other-bucket.jpg", "other"),
        ("uploads/folder/.emptyFolderPlaceholder", "media"),
        ("site/logo.png", "media"),  # THUMBQ_STORAGE_URL=s3://media/site: key logo.png
        ("site/thumbnails/logo.png/e1-512.webp", "media"),  # thumbq's own output
    ]:
        upload(sconn, name, "e1", bucket)
    rows = sconn.execute(
        "select source_key, group_id, max_attempts from thumbq.jobs order by id"
    ).fetchall()
    assert [(r["source_key"], r["group_id"], r["max_attempts"]) for r in rows] == [
        ("uploads/yes.jpg", "uploads", 3),
        ("logo.png", "site", 5),
    ]


def test_a_thumbq_failure_never_fails_the_upload(sconn: db.Conn) -> None:
    notices: list[str] = []
    sconn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    # Something in thumbq refuses this one job (a stand-in for any bug or outage).
    sconn.execute(
        "alter table thumbq.jobs add constraint no_bad check (source_key <> 'uploads/bad.jpg')"
    )
    upload(sconn, "uploads/bad.jpg", "b1")
    row = sconn.execute("select count(*) as n from storage.objects").fetchone()
    assert row == {"n": 1}, "the upload committed"
    assert jobs(sconn) == []
    assert any("could not enqueue or cancel thumbnails" in n for n in notices), notices


def test_concurrent_uploads_leave_one_waiting_job_per_objects_current_version(
    sconn: db.Conn, db_url: str
) -> None:
    names = [f"uploads/shared-{i}.jpg" for i in range(4)]
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def uploader(worker: int) -> None:
        try:
            with db.connect(db_url) as conn:
                start.wait()
                for n in range(15):
                    # Own files, and upserts racing on four shared names.
                    upload(conn, f"uploads/w{worker}/{n}.jpg", f"w{worker}-{n}")
                    upload(conn, names[(worker + n) % 4], f"s-{worker}-{n}")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=uploader, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    current = {
        (r["name"], r["etag"])
        for r in sconn.execute(
            "select name, btrim(metadata->>'eTag', '\"') as etag from storage.objects"
        ).fetchall()
    }
    assert len(current) == 8 * 15 + 4
    # Exactly the objects' current versions wait; every other version was superseded.
    assert pending(sconn) == current
    counts = sconn.execute(
        "select count(*) as all_jobs, count(*) filter (where status = 'cancelled') as superseded"
        " from thumbq.jobs"
    ).fetchone()
    assert counts == {"all_jobs": 8 * 15 * 2, "superseded": 8 * 15 - 4}
    msgs = sconn.execute("select count(*) as n from pgmq.q_thumbq_jobs").fetchone()
    assert msgs == {"n": len(current)}


def test_watching_needs_supabase_storage_and_unwatching_removes_the_triggers(
    conn: db.Conn,
) -> None:
    with pytest.raises(psycopg.errors.RaiseException, match=r"storage\.objects does not exist"):
        conn.execute("select thumbq.watch_storage('media')")
    supabase_roles(conn)
    conn.execute(STORAGE_SCHEMA.encode())
    conn.execute("select thumbq.watch_storage('media', 'a/')")
    conn.execute("select thumbq.watch_storage('media', 'b/')")

    def triggers() -> int:
        row = conn.execute(
            "select count(*) as n from pg_trigger where tgrelid = 'storage.objects'::regclass"
            " and tgname like 'thumbq_%'"
        ).fetchone()
        assert row is not None
        return int(row["n"])

    assert triggers() == 3
    conn.execute("select thumbq.unwatch_storage('media', 'a/')")
    assert triggers() == 3
    conn.execute("select thumbq.unwatch_storage('media', 'b/')")
    assert triggers() == 0
    upload(conn, "b/x.jpg", "e1")
    assert jobs(conn) == []


def test_storage_functions_are_not_an_api_for_anon_or_users(sconn: db.Conn) -> None:
    rows = sconn.execute(
        "select p.oid::regprocedure::text as fn,"
        " has_function_privilege('anon', p.oid, 'execute') as anon,"
        " has_function_privilege('authenticated', p.oid, 'execute') as authenticated"
        " from pg_proc p where p.pronamespace = 'thumbq'::regnamespace"
        " and p.proname in ('watch_storage', 'unwatch_storage', 'cancel_source',"
        "                   'storage_items', 'storage_objects_changed')"
    ).fetchall()
    assert len(rows) == 5
    assert not any(r["anon"] or r["authenticated"] for r in rows), rows
