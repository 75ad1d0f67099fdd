"""The Hub way in: hub/hf-cascade-generate, a ``custom_generate`` repository, loaded from its local path by
``generate(custom_generate=<path>, trust_remote_code=True)`` on a model loaded with sdpa: stock's tokens from the
cascade, the model's attention implementation put back after the call (also after one that raises), fallbacks."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from conftest import padded_batch, tiny_config
from test_encoder_decoder import FAMILIES as SEQ2SEQ_FAMILIES, sources
from test_families import FAMILIES as DECODER_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = str(ROOT / "hub" / "hf-cascade-generate")
HUB = dict(custom_generate=REPOSITORY, trust_remote_code=True)
NEW = 8


@pytest.fixture(scope="module", autouse=True)
def installed_hf_cascade(tmp_path_factory):
    """transformers checks custom_generate/requirements.txt against installed distributions' metadata; in a
    checkout used with PYTHONPATH=. (not pip-installed) stand in hf_cascade's, with the checkout's version."""
    try:
        importlib.metadata.version("hf_cascade")
        yield
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    from hf_cascade import __version__
    site = tmp_path_factory.mktemp("site")
    info = site / f"hf_cascade-{__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: hf_cascade\nVersion: {__version__}\n")
    sys.path.insert(0, str(site))
    yield
    sys.path.remove(str(site))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa",
                                            dtype=torch.float64).eval()


class ForwardSpy:
    """Per forward: the attention implementation the model's config named and the type of cache it got."""

    def __init__(self, model):
        self.model, self.seen, self.caches = model, [], []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.seen.append((self.model.config._attn_implementation, type(cache).__name__))
        self.caches.append(cache)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def ran_cascade(self) -> bool:
        return bool(self.seen) and all(seen == ("cascade", "CascadeCache") for seen in self.seen)

    def ran_stock(self) -> bool:
        return bool(self.seen) and all(attention != "cascade" and cache != "CascadeCache"
                                       for attention, cache in self.seen)


def attention_choices(model) -> list:
    """Each config's attention implementation, model.config's and every submodule's."""
    return [(name, module.config._attn_implementation) for name, module in model.named_modules()
            if hasattr(module, "config")]


def shared_prefix_batch():
    """Two prompts behind one 24-token system prompt: greedy has something to share."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, 90, (1, 24), generator=g).expand(2, -1)
    return torch.cat([system, torch.randint(3, 90, (2, 6), generator=g)], dim=1)


CALLS = {
    "beam_search": dict(num_beams=4, num_return_sequences=2),
    "sampling": dict(do_sample=True, num_return_sequences=3, top_k=0, temperature=1.5),
    "greedy": dict(),
}


@pytest.mark.parametrize("mode", list(CALLS))
def test_tokens_equal_stock(model, mode):
    if mode == "greedy":
        inputs = dict(input_ids=shared_prefix_batch())
    else:
        ids, mask = padded_batch(seed=7)
        inputs = dict(input_ids=ids, attention_mask=mask)
    kw = dict(max_new_tokens=NEW, pad_token_id=0, **CALLS[mode], **inputs)
    before = attention_choices(model)
    torch.manual_seed(123)
    expected = model.generate(**kw)
    torch.manual_seed(123)
    with ForwardSpy(model) as spy:
        got = model.generate(**kw, **HUB)
    assert spy.ran_cascade(), spy.seen
    assert torch.equal(expected, got)
    assert attention_choices(model) == before and model.config._attn_implementation == "sdpa"


def test_second_call_settings_and_config_left_as_it_was(model):
    ids, mask = padded_batch(seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, num_beams=3)
    config = model.config.to_dict()
    expected = model.generate(**kw)
    for block_size in (4, 8):
        with ForwardSpy(model) as spy:
            assert torch.equal(model.generate(**kw, hf_cascade_config={"block_size": block_size}, **HUB), expected)
        assert spy.ran_cascade() and spy.caches[0].cascade_config.block_size == block_size
        assert model.config.to_dict() == config and model.config._attn_implementation == "sdpa"


def test_restored_after_a_call_that_raises(model):
    ids, mask = padded_batch(seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, num_beams=2)
    before = attention_choices(model)

    def stop(input_ids, scores, **_):
        assert model.config._attn_implementation == "cascade"     # raised while the model was switched
        raise RuntimeError("raised by a stopping criterion")

    with pytest.raises(RuntimeError, match="raised by a stopping criterion"):
        model.generate(**kw, stopping_criteria=[stop], **HUB)
    assert attention_choices(model) == before
    with ForwardSpy(model) as spy:
        assert torch.equal(model.generate(**kw, **HUB), model.generate(**kw))
    assert spy.seen[0] == ("cascade", "CascadeCache")


def test_decoding_the_cascade_does_not_take_runs_stock(model):
    """Assisted decoding (prompt lookup) runs stock generate on the model as loaded; a KV cap cannot hold there."""
    ids = shared_prefix_batch()[:1]
    kw = dict(input_ids=ids, max_new_tokens=NEW, pad_token_id=0, prompt_lookup_num_tokens=3)
    expected = model.generate(**kw)
    with ForwardSpy(model) as spy:
        got = model.generate(**kw, hf_cascade_config={"backend": "reference"}, **HUB)
    assert spy.ran_stock(), spy.seen
    assert torch.equal(expected, got)
    with pytest.raises(ValueError, match="max_kv_bytes cannot be enforced on stock's path"):
        model.generate(**kw, hf_cascade_config={"max_kv_bytes": 2 ** 30}, **HUB)
    assert model.config._attn_implementation == "sdpa"


def test_a_model_the_cascade_cannot_serve_runs_stock(caplog):
    """Bloom (ALiBi, which the cascade kernels do not add): stock generate, warned with the reason."""
    torch.manual_seed(0)
    config = DECODER_FAMILIES["Bloom"].make()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    attention = model.config._attn_implementation
    ids, mask = padded_batch(seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, num_beams=2)
    expected = model.generate(**kw)
    with ForwardSpy(model) as spy:
        assert torch.equal(model.generate(**kw, **HUB), expected)
    assert spy.ran_stock(), spy.seen
    assert "hf_cascade cannot serve this model" in caplog.text and "no ALiBi bias" in caplog.text
    assert model.config._attn_implementation == attention


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_decoder(family, caplog):
    """Encoder-decoder models run the cascade too. transformers 5.17's set_attn_implementation does not reach T5's
    decoder stack (it keeps a config of its own): there the call runs stock generate, warned, and says why."""
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(SEQ2SEQ_FAMILIES[family](), attn_implementation="sdpa",
                                              dtype=torch.float64).eval()
    ids, mask = sources()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=4,
              num_return_sequences=2)
    before = attention_choices(model)
    expected = model.generate(**kw)
    with ForwardSpy(model) as spy:
        got = model.generate(**kw, **HUB)
    assert torch.equal(expected, got)
    assert attention_choices(model) == before
    if family == "t5" and Version(transformers.__version__) < Version("5.24"):
        assert spy.ran_stock() or spy.seen[0] == ("cascade", "CascadeEncoderDecoderCache"), spy.seen
        assert spy.seen[0][0] == "cascade" or "its decoder (T5Stack) kept 'sdpa' attention" in caplog.text
    else:
        assert {seen for seen in spy.seen} == {("cascade", "CascadeEncoderDecoderCache")}, spy.seen


SCRIPT = r"""
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
sys.path.insert(0, sys.argv[2])             # hf_cascade's distribution metadata where it is not installed
torch.manual_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                     eos_token_id=None)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64).eval()
ids = torch.randint(3, 96, (1, 200))       # 8 beams x 200 tokens: enough shared to pay on the CPU
kw = dict(input_ids=ids, num_beams=8, max_new_tokens=4, pad_token_id=0)
expected = model.generate(**kw)
seen = []
model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
    type(kwargs.get("cache", kwargs.get("past_key_values"))).__name__), with_kwargs=True)
assert "hf_cascade" not in sys.modules
got = model.generate(**kw, custom_generate=sys.argv[1], trust_remote_code=True)
assert seen and set(seen) == {"CascadeCache"}, seen
assert torch.equal(expected, got)
assert model.config._attn_implementation == "sdpa"
print("ok")
"""


def test_without_importing_hf_cascade(tmp_path):
    """The user's process never imports hf_cascade: the repository's generate.py does."""
    site = next((path for path in sys.path if list(Path(path).glob("hf_cascade-*.dist-info"))), str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, REPOSITORY, site], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
