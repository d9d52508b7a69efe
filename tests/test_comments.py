"""Code says why it is as it is; when and on which host a figure was measured is docs' business
(docs/performance.md), so no source file of these folders names a date, a work session or a
measuring host."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "kernels", "autotune", "profiles", "daemon", "console", "scripts")
SOURCES = ("*.py", "*.h", "*.cpp", "*.c", "*.sh")
ORDINAL = (
    r"(?:[a-z]+-)?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
    r"twelfth|[a-z]+teenth|[a-z]+tieth)"
)
# a date, an ordinal work session ("the twenty-ninth session"), the GPUs figures were measured on
NOTEBOOK = re.compile(rf"\b20\d\d-\d\d-\d\d\b|\b{ORDINAL} session\b|\bH[12]00\b")


def notebook_lines(path: Path, root: Path = ROOT) -> list[str]:
    """The lines of `path` that read like a lab notebook, as "path:line: text"."""
    return [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if NOTEBOOK.search(line)
    ]


def test_no_source_file_keeps_a_lab_notebook():
    paths = [p for folder in FOLDERS for pattern in SOURCES for p in (ROOT / folder).rglob(pattern)]
    assert len(paths) > 50
    assert [line for path in sorted(paths) for line in notebook_lines(path)] == []


def test_a_notebook_line_is_told_apart_from_code(tmp_path):
    source = tmp_path / "gemv.py"
    source.write_text(
        "# loses at eight: python -m moelab.kernels.bench, 2026-11-30.\n"
        "# 150 us decoded faster (docs/performance.md, thirty-sixth session)\n"
        "# 64 warps polling took 92 us on an H200\n"
        "# as before the twenty-ninth session\n"
        "SESSION_COOKIE = 'mgr_session'  # a session cookie, 20 minutes, with session data\n"
        "# each session of a trial; seen in 2026; H2000 rows\n"
    )
    lines = notebook_lines(source, tmp_path)
    assert [line.split(":")[1] for line in lines] == ["1", "2", "3", "4"]
