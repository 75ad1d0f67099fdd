"""The package's import graph (tools/import_graph.py): no cycles, dependencies pointing one way (DESIGN.md)."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("import_graph", Path(__file__).parent.parent / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


@pytest.fixture(scope="module")
def edges():
    return import_graph.graph()


def test_no_import_cycles(edges):
    assert import_graph.cycles(edges) == []


def test_the_kernels_and_the_block_bookkeeping_import_nothing_of_the_rest(edges):
    for name, targets in edges.items():
        if name.startswith("hf_cascade.kernels"):
            assert all(t.startswith("hf_cascade.kernels") for t in targets), (name, targets)
    assert edges["hf_cascade.kv.blocks"] == set() and edges["hf_cascade.config"] == set()


def test_no_more_floors_than_after_the_redesign(edges):
    # 15c4628 had 13 floors and 2 cycles; the step context as an argument and the splits of issue 19 left 12
    assert 1 + max(import_graph.floors(edges).values()) <= 12


def test_the_graph_sees_lazy_imports():
    # a function-level import is a dependency too: patches.generate imports generation only inside functions
    assert "hf_cascade.generation" in import_graph.graph()["hf_cascade.patches.generate"]
