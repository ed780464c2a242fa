"""One list each: the statuses, stop reasons and error codes of worker.engine.states are the
words the live schema allows and writes (its check constraints and its functions)."""

from __future__ import annotations

import dataclasses
import re

from worker.engine import db
from worker.engine.batch import BatchResult
from worker.engine.states import (
    COUNTED,
    FINAL_OUTCOMES,
    FINAL_STATUSES,
    ErrorCode,
    JobStatus,
    Outcome,
    StopReason,
)


def _check_values(conn: db.Conn, table: str, column: str) -> set[str]:
    """The words a check constraint on `thumbq.<table>.<column>` allows (`col in (...)`)."""
    rows = conn.execute(
        """select pg_get_constraintdef(c.oid) as def
             from pg_constraint c
             join pg_attribute a on a.attrelid = c.conrelid and a.attnum = any(c.conkey)
            where c.conrelid = format('thumbq.%%I', %s::text)::regclass
              and c.contype = 'c' and a.attname = %s and cardinality(c.conkey) = 1""",
        (table, column),
    ).fetchall()
    assert len(rows) == 1, f"thumbq.{table}.{column} has {len(rows)} check constraints"
    return set(re.findall(r"'([^']*)'::text", str(rows[0]["def"])))


def _function_sources(conn: db.Conn) -> str:
    rows = conn.execute(
        """select pg_get_functiondef(p.oid) as def from pg_proc p
            where p.pronamespace = 'thumbq'::regnamespace and p.prokind = 'f'"""
    ).fetchall()
    return "\n".join(str(r["def"]) for r in rows)


def test_job_statuses_are_the_check_constraint_of_jobs(conn: db.Conn) -> None:
    assert _check_values(conn, "jobs", "status") == set(JobStatus)


def test_every_job_status_has_a_count_column_in_groups(conn: db.Conn) -> None:
    columns = {
        r["attname"]
        for r in conn.execute(
            """select attname from pg_attribute
                where attrelid = 'thumbq.groups'::regclass and attnum > 0 and not attisdropped"""
        ).fetchall()
    }
    assert set(JobStatus) <= columns


def test_stop_reasons_are_the_check_constraint_of_batch_runs(conn: db.Conn) -> None:
    assert _check_values(conn, "batch_runs", "stopped_reason") == set(StopReason)


def test_every_error_code_the_sql_writes_or_reads_is_an_error_code(conn: db.Conn) -> None:
    src = _function_sources(conn)
    codes: set[str] = set()
    for pattern in (
        r"error_code\s*=\s*'(\w+)'",  # set error_code = 'x', where error_code = 'x'
        r"coalesce\(\s*\w+\.error_code\s*,\s*'(\w+)'",
        r"p_error_code\s+text\s+default\s+'(\w+)'",
        r"cancel_jobs\(array\(.*?\)\s*,\s*'(\w+)'",  # cancel_jobs(ids, 'code', ...)
    ):
        codes |= set(re.findall(pattern, src, re.IGNORECASE | re.DOTALL))
    for listed in re.findall(r"error_code\s+in\s*\(([^)]*)\)", src, re.IGNORECASE):
        codes |= set(re.findall(r"'(\w+)'", listed))
    # The patterns find what 010 and 011 write: a pattern that stopped matching would pass.
    assert {"lease_expired", "superseded", "source_missing", "unsupported_type"} <= codes
    assert codes <= set(ErrorCode), codes - set(ErrorCode)


def test_the_batch_answer_counts_every_counted_outcome() -> None:
    fields = {f.name for f in dataclasses.fields(BatchResult)}
    assert set(COUNTED) <= fields
    assert set(FINAL_OUTCOMES) <= set(COUNTED)
    assert set(FINAL_OUTCOMES.values()) == FINAL_STATUSES
    assert Outcome.WRITING not in COUNTED
