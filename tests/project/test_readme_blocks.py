"""Every ```python block of README.md runs as written (issue 13: "README snippets run as written"), each in a fresh
namespace, in a temporary directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

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


def _setup_lines_of_the_makefile() -> list[str]:
    """Regexes of the lines ``make test``'s setup prints, in the recipe's order: its ``echo "macer setup: ..."`` lines
    and the CUDA extension's line, with the Makefile's variables as they are by default."""
    makefile = (README.parent / "Makefile").read_text()
    recipe = makefile.split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]
    found = [(m.start(), re.escape(m.group(1))) for m in re.finditer(r'echo "(macer setup: [^"]*)"', recipe)]
    cuda = re.search(r"print\('(macer setup: CUDA extension)', '([^']*)' if .*? else '([^']*)'\)", recipe, re.S)
    assert cuda, "the Makefile's setup no longer prints the CUDA extension's line as this test reads it"
    found.append((cuda.start(), f"{re.escape(cuda.group(1))} ({re.escape(cuda.group(2))}|{re.escape(cuda.group(3))})"))
    substitutions = {re.escape("$(VENV)"): ".venv", re.escape("$(LOG)"): r"\.venv/setup\.log",
                     re.escape("$$($(PYTHON) --version)"): r"Python 3\.\d+\.\d+"}
    lines = []
    for _, pattern in sorted(found):
        for variable, value in substitutions.items():
            pattern = pattern.replace(variable, value)
        assert "$" not in pattern, f"a Makefile variable this test does not know: {pattern}"
        lines.append(pattern)
    return lines


def test_readme_setup_output_is_what_make_test_prints():
    """The README's block of setup lines is what the Makefile's setup prints on a first run: every line, in order
    (it once lacked the lmms-eval step)."""
    text = README.read_text()
    block = next((b for b in re.findall(r"^```\n(.*?)^```$", text, re.M | re.S) if b.startswith("macer setup:")), None)
    assert block, "README.md has no block of `macer setup:` lines"
    shown = block.splitlines()
    expected = _setup_lines_of_the_makefile()
    assert len(shown) == len(expected), (shown, expected)
    for line, pattern in zip(shown, expected, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)
