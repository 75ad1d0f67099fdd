"""The docs cannot drift from the code: the generated pages are what tools/docs_pages.py writes, the architecture page
names every module, every environment variable the package reads is documented, and the README stays a front page
whose commands are the ones CI runs."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest
import transformers
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def pages():
    spec = importlib.util.spec_from_file_location("docs_pages", ROOT / "tools" / "docs_pages.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize("name", ["configuration.md", "environment.md", "families.md", "modules.md"])
def test_generated_pages_are_fresh(pages, name):
    if name == "families.md" and Version(transformers.__version__) < Version("5.24"):
        pytest.skip("the family table is made on transformers >= 5.24")
    assert (DOCS / name).read_text(encoding="utf-8") == pages.PAGES[name](), \
        f"docs/{name} is stale: run python tools/docs_pages.py"


def test_configuration_page_names_every_field():
    from hf_cascade import CascadeConfig
    import dataclasses
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for field in dataclasses.fields(CascadeConfig):
        assert f"\n## {field.name}\n" in text, field.name


def test_a_field_without_a_description_stops_the_generator(pages, monkeypatch):
    monkeypatch.setattr(pages, "_args_section", lambda doc: {})
    with pytest.raises(SystemExit, match="no Args: entry"):
        pages.configuration()


def test_modules_page_names_every_module():
    text = (DOCS / "modules.md").read_text(encoding="utf-8")
    modules = sorted([*ROOT.glob("hf_cascade/**/*.py"), *ROOT.glob("patches/*.py")])
    assert len(modules) > 40
    missing = [str(m.relative_to(ROOT)) for m in modules if f"`{m.relative_to(ROOT)}`" not in text]
    assert not missing, f"docs/modules.md misses these modules (run python tools/docs_pages.py): {missing}"


def test_every_environment_variable_read_is_documented():
    from hf_cascade.diagnostics import ENV_VARS
    read = set()
    for path in [*ROOT.glob("hf_cascade/**/*.py"), *ROOT.glob("patches/*.py"), ROOT / "setup.py"]:
        read |= set(re.findall(r"HF_CASCADE_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    assert read and read <= set(ENV_VARS), read - set(ENV_VARS)


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 12_500, "the README is the front page: move the detail into docs/"
    assert 'attn_implementation="cascade"' in text.split("\n\n", 2)[1]       # the first paragraph names the flag
    assert "pip install torch==2.13.0 -e . && python -m hf_cascade" in text
    test_command = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q'
    assert test_command in text and test_command in (ROOT / ".ci" / "run").read_text()    # CI runs the README's
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", text):
        assert (ROOT / target).exists(), target


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        assert f" {page.name}" in nav, page.name


def test_the_gpu_suite_script_runs_every_file_with_gpu_tests():
    script = (ROOT / "tools" / "gpu_tests.sh").read_text(encoding="utf-8")
    listed = set(re.findall(r"tests/((?:\w+/)?test_\w+\.py)", script))
    marked = {str(path.relative_to(ROOT / "tests")) for path in (ROOT / "tests").rglob("test_*.py")  # (this file only names the mark)
              if path.name != "test_docs.py" and re.search(r"mark\.gpu\b", path.read_text(encoding="utf-8"))}
    assert marked and listed == marked, (sorted(marked - listed), sorted(listed - marked))


def _gpu_tests_named_otherwise(path) -> list[str]:
    """The GPU tests of ``path`` (marked ``gpu`` by the module, a decorator or a parameter's marks) whose file and
    function names both leave "gpu" out."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    module_marked = any(isinstance(node, ast.Assign) and "gpu" in ast.unparse(node.value)
                        and any(getattr(t, "id", None) == "pytestmark" for t in node.targets) for node in tree.body)
    aliases = {t.id for node in tree.body if isinstance(node, ast.Assign) and "mark.gpu" in ast.unparse(node.value)
               for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and "gpu" not in node.name:
            marks = " ".join(ast.unparse(d) for d in node.decorator_list)
            if module_marked or "mark.gpu" in marks or any(re.search(rf"\b{a}\b", marks) for a in aliases):
                found.append(node.name)
    return found


def test_gpu_tests_are_recognisable_by_name():
    """A test that needs the GPU says so in its file's name (tests/test_gpu_*.py) or its own (test_gpu_*, *_gpu_*):
    ``-k gpu`` and a reader find them all."""
    unnamed = {path.name: names for path in (ROOT / "tests").rglob("test_*.py") if "gpu" not in path.name
               for names in [_gpu_tests_named_otherwise(path)] if names}
    assert not unnamed, unnamed


def test_the_gpu_name_check_sees_each_way_of_marking(tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text("import pytest\ngpu = pytest.mark.gpu\n\n@gpu\ndef test_a(): pass\n\n@pytest.mark.gpu\n"
                    "def test_b(): pass\n\n@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.gpu)])\n"
                    "def test_c(x): pass\n\ndef test_d(): pass\n\n@gpu\ndef test_gpu_e(): pass\n", encoding="utf-8")
    assert _gpu_tests_named_otherwise(path) == ["test_a", "test_b", "test_c"]
    path.write_text("import pytest\npytestmark = pytest.mark.gpu\n\ndef test_a(): pass\n", encoding="utf-8")
    assert _gpu_tests_named_otherwise(path) == ["test_a"]
