"""Every code block the docs mark as executed runs, and prints exactly the output the docs show.

The convention (docs/plugins.md, docs/agents.md): a paragraph that says
``(executed; its output follows)``, then a ```` ```python ```` block, then a
fenced block (```` ``` ```` or ```` ```text ````) holding what it prints. Each
block runs in its own interpreter from the repository root; the printed text
must equal the shown text (trailing blanks aside), so the docs cannot drift
from the code again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"executed;\s+its\s+output\s+follows", re.IGNORECASE)
FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def executed_examples() -> list[tuple[str, str, str]]:
    """``(where, code, shown output)`` for each marked example under docs/ (ValueError for a broken marker)."""
    found = []
    for path in sorted((REPO / "docs").rglob("*.md")):
        text = path.read_text()
        for marker in MARKER.finditer(text):
            line = text.count("\n", 0, marker.start()) + 1
            where = f"{path.relative_to(REPO)}:{line}"
            blocks = list(FENCE.finditer(text, marker.end()))[:2]
            between = text[marker.end(): blocks[0].start()] if blocks else ""
            if (len(blocks) < 2 or blocks[0].group(1) != "python" or blocks[1].group(1) not in ("", "text")
                    or between.strip() not in ("", ":", ").", ")", "):")
                    or text[blocks[0].end(): blocks[1].start()].strip()):
                raise ValueError(f"{where}: 'executed; its output follows' must be followed by a ```python block "
                                 "and, right after it, a ``` or ```text block with its output")
            found.append((where, blocks[0].group(2), blocks[1].group(2)))
    return found


EXAMPLES = executed_examples()


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def test_the_docs_mark_their_executed_examples():
    places = {where.split(":")[0] for where, _, _ in EXAMPLES}
    # the two documents that carry executed examples today; a changed marker would otherwise test nothing
    assert {"docs/plugins.md", "docs/agents.md"} <= places, places


@pytest.mark.parametrize(("where", "code", "shown"), EXAMPLES, ids=[w for w, _, _ in EXAMPLES])
def test_executed_example_prints_what_the_docs_show(where, code, shown):
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-"], input=code, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"{where}: the example failed:\n{proc.stderr[-3000:]}"
    printed, expected = _normalise(proc.stdout), _normalise(shown)
    if printed != expected:
        import difflib

        diff = "\n".join(difflib.unified_diff(expected.splitlines(), printed.splitlines(), "shown in the docs",
                                              "printed", lineterm=""))
        pytest.fail(f"{where}: the example's output differs from the docs:\n{diff}")
