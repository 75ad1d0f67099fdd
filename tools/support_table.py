"""Print the model-family support table (docs/families.md), generated from the test matrix.

    python tools/support_table.py

Imports ``FAMILIES`` from ``tests/test_families.py`` (builds no model, runs nothing heavy) and prints
a Markdown table: family | beam search | sampling | greedy | status/test.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def load_families():
    sys.path.insert(0, TESTS)        # test_families imports conftest as a top-level module
    try:
        import test_families
    finally:
        sys.path.remove(TESTS)
    return test_families


def cell(family, mode) -> str:
    if mode not in family.modes:
        return "not tested"
    return {"exact": "token-exact", "refused": "refused (clear error)", "load error": "refused at load (clear error)"}[family.status]


def table() -> str:
    tf = load_families()
    head = ["family", *(tf.MODE_TITLES[m] for m in tf.MODES), "status/test"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, family in tf.FAMILIES.items():
        status = {"exact": "stock's tokens", "refused": "refused", "load error": "refused at load"}[family.status]
        dtype = str(family.dtype).replace("torch.", "")
        detail = f"{status}: {family.quirks} ({dtype})" if family.quirks else f"{status} ({dtype})"
        cells = [name, *(cell(family, m) for m in tf.MODES), f"{detail}; `tests/test_families.py`"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
