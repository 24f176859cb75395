"""scripts/gpu_session.sh, the published GPU evidence in parts: it parses, and its header documents every part.

The script runs only on a lent GPU, a few calls a session, so a typo there costs device time; its header is
where the next session looks up what a part does (session 63 found two parts missing from it: serve-tune and
noncausal).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_session.sh"


def header_and_parts(text: str) -> tuple[str, list[str]]:
    """The header (everything before the script's first command, ``set -u``), and every name a ``case`` label of
    the parts' loop accepts (``a|b)`` gives both)."""
    header = text[: text.index("\nset ")]
    loop = text[text.index('for part in "$@"; do'):]
    labels = re.findall(r"^    ([a-z0-9|-]+)\)", loop, re.M)
    return header, [name for label in labels for name in label.split("|")]


def test_header_documents_every_part() -> None:
    header, parts = header_and_parts(SCRIPT.read_text())
    assert len(parts) > 40, parts  # the parser found the loop
    missing = [part for part in parts if not re.search(rf"(?<![\w-]){re.escape(part)}(?![\w-])", header)]
    assert not missing, f"parts of gpu_session.sh its header does not mention: {missing}"


def test_header_check_catches_an_undocumented_part() -> None:
    text = SCRIPT.read_text().replace('for part in "$@"; do\n', 'for part in "$@"; do\n  case x in\n    zz-new)\n',
                                      1)
    header, parts = header_and_parts(text)
    assert "zz-new" in parts and "zz-new" not in header


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
