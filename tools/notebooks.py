"""Execute the example notebooks in place, so that they are committed with their outputs and plots.

    python tools/notebooks.py [NAME.ipynb ...]      # all of examples/notebooks/ by default; a few minutes on a CPU

Offline (the built-in random models), one torch thread, progress bars off: the outputs are the ones
``tests/test_notebooks.py`` gets when it runs them again, up to timings (it compares the two, numbers within a
tolerance). Rerun it after changing a notebook or what it prints.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time

import nbclient
import nbformat

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "notebooks"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def execute(path: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook at ``path`` run top to bottom in a fresh kernel (the environment: :data:`ENV`)."""
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)      # timestamps: a diff on every run
    return nb


def main(argv=None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    os.environ.update(ENV)
    os.environ.pop("HF_CASCADE_MODEL", None)
    for name in names:
        start = time.perf_counter()
        nbformat.write(execute(NOTEBOOKS / name), NOTEBOOKS / name)
        print(f"{name}: {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
