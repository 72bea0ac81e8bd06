"""docs/ARCHITECTURE.md names the file of every arrow of a checkpoint's life: each file it names
exists (a module moved or renamed without the page following fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_the_architecture_page_names_exists() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"(?<![\w/.])((?:[a-z_]+/)+[a-z_*]+\.py)", text))
    assert len(named) > 40, "the page names too few files: was it rewritten without paths?"
    missing = []
    for name in sorted(named):
        bases = (
            ROOT / "ckptflow",
            ROOT / "ckptflow" / "training_hooks",
            ROOT,
        )  # training_hooks/ paths are short
        matches = [m for base in bases for m in base.glob(name)]
        if not matches:
            missing.append(name)
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
