"""The README and docs/ as a newcomer reads them (issue 10, point 11): short, every link leads
somewhere in the repository, every setting and command they name exists."""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

from worker.cli import build_parser
from worker.engine.config import Config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A file of the repository named in prose or a comment: `worker/engine/batch.py`, sql/retired.sql.
FILE_NAMED = re.compile(
    r"(?<![\w/.-])((?:api|bench|docs|examples|sql|supabase|tests|worker)/[\w/.-]*"
    r"\.(?:css|html|js|json|md|png|py|sql|toml))\b"
)


def _code_free(text: str) -> str:
    """The text without fenced code blocks (a link-like string in code is not a link)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_every_link_of_the_readme_and_docs_exists_in_the_repository() -> None:
    # Regression: the README linked ../shared/DESIGN.md, which is not in the repository.
    for page in [README, *DOCS]:
        for target in LINK.findall(_code_free(page.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert path.exists(), f"{page.name} links to {target}, which does not exist"


def test_every_file_the_docs_and_comments_name_exists() -> None:
    # Regression: comments named files the repository does not hold (issue 21).
    sources = [README, *DOCS]
    for folder, pattern in (("api", "**/*.py"), ("bench", "*.py"), ("examples", "*.py")):
        sources += sorted((ROOT / folder).glob(pattern))
    sources += sorted((ROOT / "worker").glob("**/*.py")) + sorted((ROOT / "sql").glob("**/*.sql"))
    # A released schema file is frozen as shipped (sql/released.json), its comments too.
    released = {
        name
        for release in json.loads((ROOT / "sql/released.json").read_text(encoding="utf-8"))[
            "releases"
        ]
        for name in release["files"]
    }
    for source in sources:
        if str(source.relative_to(ROOT)) in released:
            continue
        for name in FILE_NAMED.findall(source.read_text(encoding="utf-8")):
            if "..." in name or "NNN" in name:
                continue  # a pattern of names, not a file
            where = source.relative_to(ROOT)
            assert (ROOT / name).exists(), f"{where} names {name}, which does not exist"


def test_the_readme_is_what_a_user_needs_first_and_the_reference_lives_in_docs() -> None:
    # Regression: a 500-line README with the operations SQL, the performance report and an
    # internal account of what was tested in the middle.
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[:3] == ["Two commands", "A 5-minute tour", "Deploy"], headings
    assert "Configuration" in headings and "Licence" in headings
    for moved in ("Operations in SQL", "Performance", "HTTP API"):
        assert moved not in headings
    assert (ROOT / "docs" / "operations.md").exists() and (
        ROOT / "docs" / "performance.md"
    ).exists()
    # The two commands: the main job on the embedded default, and the tests.
    block = re.search(r"## Two commands.*?```sh\n(.*?)```", text, flags=re.S)
    assert block, "the two commands are in one sh block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == [
        "pip install '.[local]' && thumbq up",
        "pip install '.[test]' && python -m pytest",
    ]


def test_the_readme_lists_every_setting_thumbq_reads() -> None:
    source = inspect.getsource(Config.from_env) + inspect.getsource(
        __import__("worker.engine.config", fromlist=["x"])
    )
    names = set(re.findall(r'"((?:THUMBQ|SUPABASE|AWS)_[A-Z_]+|DATABASE_URL|CRON_SECRET)"', source))
    table = README.read_text(encoding="utf-8").split("## Configuration", 1)[1]
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert not missing, f"the README's configuration table lacks {missing}"


def test_every_command_the_docs_name_exists() -> None:
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(subs.choices)
    for page in [README, *DOCS]:
        for name in re.findall(r"`thumbq ([a-z][a-z-]*)", page.read_text(encoding="utf-8")):
            assert name in commands, f"{page.name} names `thumbq {name}`, which does not exist"
