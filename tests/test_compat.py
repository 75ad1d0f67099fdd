"""hf_cascade.compat is the one place that knows the supported transformers range: the packaging metadata, CI and
the README say the same range (they cannot import the package), and every patch acts only inside it."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import transformers

from hf_cascade import compat

ROOT = Path(__file__).resolve().parent.parent


def test_the_packaging_metadata_requires_compat_s_range():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    required = [line.strip() for line in setup["options"]["install_requires"].splitlines()
                if line.strip().startswith("transformers")]
    assert required == [f"transformers{compat.range_text()}"], required


def test_ci_and_the_features_page_name_the_tested_ends():
    low, high = compat.TESTED
    assert f'"transformers=={low}"' in (ROOT / ".ci" / "run").read_text()
    features = (ROOT / "docs" / "features.md").read_text()
    assert f"| transformers | {low.major}.{low.minor} – {high.major}.{high.minor} (CI runs both ends)" in features
    assert compat.SUPPORTED[0] <= low < high < compat.SUPPORTED[1]


def test_the_installed_version_is_inside_the_range_and_the_patches_use_it():
    from hf_cascade import patches
    assert compat.in_range(), transformers.__version__
    for module in (patches.families, patches.generate, patches.positions, patches.t5_mask, patches.whisper_encoder):
        assert module.SUPPORTED is compat.SUPPORTED, module.__name__


def test_no_module_spells_out_a_version_or_both_cache_names():
    """A transformers version difference is decided in compat, not by hand elsewhere: no ``Version("5.`` and no
    ``"cache" ... "past_key_values"`` pair outside it."""
    pattern = re.compile(r'Version\("5\.|transformers\.__version__\.split|"cache"[^\n]*"past_key_values"')
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("hf_cascade", "patches")
             for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "compat.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
