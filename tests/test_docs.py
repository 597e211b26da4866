"""The documentation site builds with ``mkdocs build --strict``: every page in the nav exists, every example
included from a file (pymdownx.snippets) exists, every link resolves, every API page's module imports."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_MISSING = [
    m
    for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx")
    if importlib.util.find_spec(m.split(".")[0]) is None or importlib.util.find_spec(m) is None
]


@pytest.mark.skipif(bool(_MISSING), reason=f"docs dependencies not installed ({_MISSING}): pip install -e '.[docs]'")
def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # snippets paths are relative to the repository root
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    site = tmp_path / "site"
    for page in ("index.html", "lab/index.html", "benchmarks/index.html", "api/recipe/index.html"):
        assert (site / page).is_file(), page
    # The examples are included from their files, not copied: the rendered page contains the live source.
    example_page = re.sub(r"<[^>]+>", "", (site / "examples" / "index.html").read_text())  # drop highlighting spans
    assert "def load_corpus" in example_page and "class LitGPT" in example_page
