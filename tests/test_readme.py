"""Every ```python block of README.md runs as written (issue 13: "README snippets run as written"), each in a fresh
namespace, in a temporary directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

# Blocks that fail on main today, keyed by their section heading. strict=True: the test fails once a block runs, so
# the mark is removed together with the fix.
KNOWN_BROKEN: dict[str, str] = {}


def _python_blocks() -> list[tuple[str, str]]:
    """``(heading, code)`` of each ```python block, the heading being the nearest ``#`` title above it."""
    blocks, heading = [], ""
    # Fenced blocks are matched whole, so that a "# comment" line inside one is not taken for a heading.
    for match in re.finditer(r"^```(\w*)\n(.*?)^```$|^#{1,6} ([^\n]+)$", README.read_text(), re.M | re.S):
        if match.group(3) is not None:
            heading = match.group(3).strip()
        elif match.group(1) == "python":
            blocks.append((heading, match.group(2)))
    return blocks


BLOCKS = _python_blocks()


def test_readme_has_python_blocks():
    assert BLOCKS, f"no ```python block found in {README}"


@pytest.mark.parametrize(
    "heading, code",
    [pytest.param(h, c, id=f"{i}-{h}", marks=[pytest.mark.xfail(strict=True, raises=NameError, reason=KNOWN_BROKEN[h])]
                  if h in KNOWN_BROKEN else []) for i, (h, c) in enumerate(BLOCKS)],
)
def test_readme_python_block_runs(heading, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md ({heading})", "exec"), {"__name__": "__readme__"})
