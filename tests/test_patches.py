"""Guards on the transformers internals hf_cascade's generate patch relies on: if upstream changes
under the patch, these fail before users get wrong behaviour."""
from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers import GenerationMixin

import hf_cascade
from hf_cascade.generation import cascade_generate
from conftest import FirstForwardRows, model_pair, padded_batch


def test_generate_is_wrapped_once():
    from hf_cascade import patches
    assert patches.generate_patch_applied()
    assert GenerationMixin.generate.__hf_cascade_original__ is not None
    patches.apply()                                  # idempotent
    assert not hasattr(GenerationMixin.generate.__hf_cascade_original__, "__hf_cascade_original__")


def test_upstream_generate_hooks_still_exist():
    original = GenerationMixin.generate.__hf_cascade_original__
    params = inspect.signature(original).parameters
    for name in ("custom_generate", "streamer", "assistant_model", "synced_gpus", "kwargs"):
        assert name in params, f"generate() lost its {name!r} parameter"
    for method in (GenerationMixin._sample, GenerationMixin._beam_search):
        names = list(inspect.signature(method).parameters)
        assert names[:6] == ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config",
                             "synced_gpus"], f"{method.__name__} changed its signature: {names}"
    # custom callables get their own extra keyword arguments (how our streamer and config travel)
    assert hasattr(GenerationMixin, "_extract_generation_mode_kwargs")
    extra = set(inspect.signature(cascade_generate).parameters) - set(inspect.signature(GenerationMixin._sample).parameters)
    assert {"hf_cascade_streamer", "hf_cascade_config"} <= extra


def test_custom_generate_callable_receives_expanded_inputs():
    """Our entry relies on generate expanding each prompt to n consecutive rows before calling it."""
    _, cascade = model_pair("llama")
    ids, mask = padded_batch(seed=0)
    seen = {}

    def spy(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
            **model_kwargs):
        seen["ids"] = input_ids.clone()
        return input_ids

    cascade.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=2, pad_token_id=0,
                     custom_generate=spy)
    assert torch.equal(seen["ids"], ids.repeat_interleave(3, 0))


def test_non_cascade_models_are_untouched():
    stock, _ = model_pair("llama")
    ids, mask = padded_batch(seed=0)
    rows = FirstForwardRows(stock)
    try:
        stock.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=2, pad_token_id=0)
    finally:
        rows.remove()
    assert rows.rows[0] == 6 and type(rows.caches[0]).__name__ == "DynamicCache"


def test_cascade_model_routes_to_entry_and_config_travels():
    _, cascade = model_pair("llama")
    ids, mask = padded_batch(seed=0)
    rows = FirstForwardRows(cascade)
    try:
        cascade.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=2, pad_token_id=0,
                         hf_cascade_config=hf_cascade.CascadeConfig(block_size=2))
    finally:
        rows.remove()
    cache = rows.caches[0]
    assert isinstance(cache, hf_cascade.CascadeCache) and cache.block_size == 2
    assert rows.rows[0] == 2


def test_version_guard_covers_installed_transformers():
    from packaging.version import Version
    from hf_cascade.patches.generate import SUPPORTED
    assert SUPPORTED[0] <= Version(transformers.__version__) < SUPPORTED[1]


def test_registration_and_loading_paths():
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from conftest import tiny_config
    assert "cascade" in AttentionInterface._global_mapping
    assert "cascade" in AttentionMaskInterface._global_mapping
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    model.set_attn_implementation("cascade")
    assert model.config._attn_implementation == "cascade"
    with pytest.raises(ValueError):
        AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="cascad")


def test_from_pretrained_with_cascade(tmp_path):
    from transformers import AutoModelForCausalLM
    from conftest import tiny_config
    stock = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float64)
    stock.eval().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="cascade", dtype=torch.float64).eval()
    assert loaded.config._attn_implementation == "cascade"
    ids, mask = padded_batch(seed=0)
    kw = dict(num_beams=3, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       loaded.generate(input_ids=ids, attention_mask=mask, **kw))


def test_own_attention_table_gives_clear_error_at_load(monkeypatch):
    """A model that indexes its own attention-class table while it is built, where that table has no "cascade" entry
    (GPT-Neo without the entry patches/families.py adds): refused with the reason, not a KeyError."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig
    from transformers.models.gpt_neo import modeling_gpt_neo
    from hf_cascade import patches
    assert patches.loading_patch_applied()
    monkeypatch.delitem(modeling_gpt_neo.GPT_NEO_ATTENTION_CLASSES, "cascade")

    def config():
        return GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, attention_types=[[["global"], 1]])

    with pytest.raises(NotImplementedError, match="table of its own.*attn_implementation='eager'"):   # it has no sdpa
        AutoModelForCausalLM.from_config(config(), attn_implementation="cascade")
    AutoModelForCausalLM.from_config(config(), attn_implementation="eager")


def _falcon_config(**overrides):
    from transformers import FalconConfig
    return FalconConfig(**{"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                           "alibi": False, "pad_token_id": 0, "eos_token_id": None, **overrides})


def test_falcon_patch_fits_installed_transformers():
    """Before 5.25 Falcon builds its attention from FALCON_ATTENTION_CLASSES, with the forward signature, head split
    and RoPE our FalconCascadeAttention relies on; the table's "cascade" entry builds it. From 5.25 it has no table and
    its own attention calls the interface: the patch leaves it, and a cascade Falcon's layers are stock's."""
    from transformers import AutoModelForCausalLM
    from transformers.models.falcon import modeling_falcon
    from hf_cascade import patches
    from hf_cascade.compat import FALCON_ROUTES_ATTENTION
    from hf_cascade.generation import routes_attention
    from hf_cascade.patches.families import SUPPORTED, falcon_unchanged_reason
    from packaging.version import Version
    assert SUPPORTED[0] <= Version(transformers.__version__) < SUPPORTED[1]
    assert patches.families_patch_applied()
    if FALCON_ROUTES_ATTENTION:
        assert not hasattr(modeling_falcon, "FALCON_ATTENTION_CLASSES")
        assert "ALL_ATTENTION_FUNCTIONS" in modeling_falcon.FalconAttention.forward.__code__.co_names
        model = AutoModelForCausalLM.from_config(_falcon_config(new_decoder_architecture=True, num_kv_heads=2),
                                                 attn_implementation="cascade")
        assert routes_attention(model)
        assert type(model.transformer.h[0].self_attention) is modeling_falcon.FalconAttention
        return
    assert falcon_unchanged_reason() is None
    assert "FALCON_ATTENTION_CLASSES[" in inspect.getsource(modeling_falcon.FalconDecoderLayer.__init__)
    # stock's new architecture broadcasts its K/V heads to every query head (we store them once, unbroadcast)
    assert "broadcast_to(key, query.shape)" in inspect.getsource(modeling_falcon.FalconAttention._split_heads)
    attention = modeling_falcon.FALCON_ATTENTION_CLASSES["cascade"](_falcon_config(), 0)
    assert isinstance(attention, modeling_falcon.FalconAttention) and attention.num_key_value_groups == 4
    patches.apply()                                  # idempotent
    assert modeling_falcon.FALCON_ATTENTION_CLASSES["cascade"] is not None


def test_falcon_new_architecture_stores_each_kv_head_once():
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_falcon_config(new_decoder_architecture=True, num_kv_heads=2),
                                             attn_implementation="cascade", dtype=torch.float64).eval()
    ids, mask = padded_batch(seed=0)
    cache = hf_cascade.CascadeCache(model.config)
    hf_cascade.prefill(model, cache, ids % 64, mask)
    assert cache.layers[0].storage.block_shape[2] == 2          # (K/V, block, kv heads, head_dim)


def test_falcon_dense_forward_and_attention_weights_are_stock():
    """Without our cache (a loss pass) and with output_attentions, the cascade Falcon computes what stock does:
    before 5.25 stock eager's (stock sdpa's output_attentions branch adds its boolean mask to the scores; our module
    runs stock's eager branch for weights); from 5.25, where Falcon routes its attention itself, stock sdpa's, as for
    every routed family (stock eager's softmax is float32 there, and sdpa returns no weights)."""
    from transformers import AutoModelForCausalLM
    from hf_cascade.compat import FALCON_ROUTES_ATTENTION
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(_falcon_config(new_decoder_architecture=True, num_kv_heads=2),
                                             attn_implementation="sdpa" if FALCON_ROUTES_ATTENTION else "eager",
                                             dtype=torch.float64).eval()
    cascade = AutoModelForCausalLM.from_config(_falcon_config(new_decoder_architecture=True, num_kv_heads=2),
                                               attn_implementation="cascade", dtype=torch.float64).eval()
    cascade.load_state_dict(stock.state_dict())
    ids, mask = padded_batch(seed=1)
    with torch.no_grad():
        expected = stock(input_ids=ids % 64, attention_mask=mask, use_cache=False, output_attentions=True)
        got = cascade(input_ids=ids % 64, attention_mask=mask, use_cache=False, output_attentions=True)
        dense = cascade(input_ids=ids % 64, attention_mask=mask, use_cache=False).logits
    real = mask.bool()             # a padding position attends to nothing: eager and sdpa fill it differently
    assert torch.allclose(expected.logits[real], dense[real], atol=1e-12)
    assert torch.equal(expected.logits, got.logits)
    assert len(expected.attentions) == len(got.attentions)
    assert all(a is b is None if a is None else torch.equal(a, b) for a, b in zip(expected.attentions, got.attentions))


def _assert_same_forward(stock, cascade) -> None:
    """A forward without a cache (the dense path, attention weights returned) equals stock's exactly."""
    ids, mask = padded_batch(seed=1)
    with torch.no_grad():
        expected = stock(input_ids=ids % 64, attention_mask=mask, use_cache=False, output_attentions=True)
        got = cascade(input_ids=ids % 64, attention_mask=mask, use_cache=False, output_attentions=True)
    assert torch.equal(expected.logits, got.logits)
    assert all(torch.equal(a, b) for a, b in zip(expected.attentions, got.attentions))


@pytest.mark.parametrize("name", ["gptj", "codegen"])
def test_gptj_and_codegen_attention_is_routed(name):
    """transformers from ~5.2x routes GPT-J's and CodeGen's attention through AttentionInterface itself; before,
    patches/families.py routes their ``_attn(query, key, value, attention_mask)``, whose weights (output_attentions)
    stay stock eager's."""
    import importlib
    from transformers import AutoModelForCausalLM, CodeGenConfig, GPTJConfig
    from hf_cascade.generation import routes_attention
    from hf_cascade.patches.families import _unrouted
    module = f"transformers.models.{name}.modeling_{name}"
    attention = {"gptj": "GPTJAttention", "codegen": "CodeGenAttention"}[name]
    config = {"gptj": GPTJConfig, "codegen": CodeGenConfig}[name]

    def make():
        return config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None)

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(make(), attn_implementation="eager", dtype=torch.float32).eval()
    cascade = AutoModelForCausalLM.from_config(make(), attn_implementation="cascade", dtype=torch.float32).eval()
    cascade.load_state_dict(stock.state_dict())
    assert routes_attention(cascade)
    if "ALL_ATTENTION_FUNCTIONS" in vars(importlib.import_module(module)):
        assert _unrouted(module, attention) is None          # routed upstream: nothing to patch
        return
    assert _unrouted(module, attention) is not None          # stock's _attn(query, key, value, attention_mask)
    assert not routes_attention(stock)
    layer = cascade.transformer.h[0].attn
    assert type(layer).__name__.endswith("CascadeAttention")
    _assert_same_forward(stock, cascade)


def test_gpt_neo_patch_fits_and_keeps_stock_weights():
    """GPT-Neo still builds its self-attention from GPT_NEO_ATTENTION_CLASSES and masks its local window in
    ``_attn(query, key, value, attention_mask)`` from the ``bias`` buffer (what the cascade entry replaces); with
    output_attentions the cascade model gives stock eager's weights, and its local layers pass their window."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig
    from transformers.models.gpt_neo import modeling_gpt_neo
    from hf_cascade.generation import routes_attention
    base = modeling_gpt_neo.GPTNeoSelfAttention
    assert "GPT_NEO_ATTENTION_CLASSES[" in inspect.getsource(modeling_gpt_neo.GPTNeoAttention.__init__)
    assert tuple(inspect.signature(base._attn).parameters) == ("self", "query", "key", "value", "attention_mask")
    assert "self.bias[" in inspect.getsource(base._attn)

    def make():
        return GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                            attention_types=[[["global", "local"], 1]], max_position_embeddings=64, pad_token_id=0)

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(make(), attn_implementation="eager").eval()
    cascade = AutoModelForCausalLM.from_config(make(), attn_implementation="cascade").eval()
    cascade.load_state_dict(stock.state_dict())
    assert routes_attention(cascade) and not routes_attention(stock)
    assert [layer.attn.attention.window for layer in cascade.transformer.h] == [None, 4]
    _assert_same_forward(stock, cascade)


def test_gpt_neo_window_with_a_shared_system_prompt_and_right_padding():
    """GPT-Neo's window (config.window_size on its "local" layers, no config.sliding_window) counts as a sliding
    window for generate: a system prompt common to the batch is not stored once across prompts (stock's window
    counts the other prompts' pad columns) and right padding runs stock's path; both give stock's tokens."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    def make():
        return GPTNeoConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, window_size=8,
                            initializer_range=0.2, attention_types=[[["global", "local"], 1]],
                            max_position_embeddings=256, pad_token_id=0)

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(make(), attn_implementation="eager").eval()
    cascade = AutoModelForCausalLM.from_config(make(), attn_implementation="cascade").eval()
    cascade.load_state_dict(stock.state_dict())
    g = torch.Generator().manual_seed(5)
    system = torch.randint(2, 64, (40,), generator=g)
    prompts = [torch.cat([system, torch.randint(2, 64, (n,), generator=g)]) for n in (9, 3)]
    width = len(prompts[0])
    for side in ("left", "right"):
        ids, mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            where = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
            ids[row, where], mask[row, where] = prompt, 1
        for extra in (dict(num_beams=4, num_return_sequences=2), dict(do_sample=True, num_return_sequences=3)):
            torch.manual_seed(1)
            expected = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **extra)
            torch.manual_seed(1)
            got = cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **extra)
            assert torch.equal(expected, got), (side, extra)


def test_xglm_patch_fits_and_routes_only_cascade_self_attention():
    """XGLM's decoder layer still builds its self-attention as XGLMAttention, whose forward takes the cache and
    computes the attention itself; a cascade model's self-attention gets the routed subclass (a stock model's
    keeps stock's class) and a dense forward gives stock's logits."""
    from transformers import AutoModelForCausalLM, XGLMConfig
    from transformers.models.xglm import modeling_xglm
    from hf_cascade.generation import routes_attention
    assert "self.self_attn = XGLMAttention(" in inspect.getsource(
        modeling_xglm.XGLMDecoderLayer.__init__.__hf_cascade_original__)
    params = inspect.signature(inspect.unwrap(modeling_xglm.XGLMAttention.forward)).parameters
    assert {"hidden_states", "key_value_states", "attention_mask"} <= set(params)
    assert {"cache", "past_key_values"} & set(params)

    def make():
        return XGLMConfig(vocab_size=64, d_model=32, num_layers=1, attention_heads=4, ffn_dim=48,
                          max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=1)

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(make(), attn_implementation="eager").eval()
    cascade = AutoModelForCausalLM.from_config(make(), attn_implementation="cascade").eval()
    cascade.load_state_dict(stock.state_dict())
    assert type(stock.model.layers[0].self_attn) is modeling_xglm.XGLMAttention and not routes_attention(stock)
    assert type(cascade.model.layers[0].self_attn).__name__ == "XGLMCascadeAttention" and routes_attention(cascade)
    ids, mask = padded_batch(seed=1)
    with torch.no_grad():
        expected = stock(input_ids=ids % 64, attention_mask=mask, use_cache=False).logits
        got = cascade(input_ids=ids % 64, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert torch.allclose(expected[real], got[real], atol=1e-5)


def test_alibi_is_refused_with_the_reason():
    """ALiBi Falcons are refused at load, Bloom at generate: the cascade kernels add no ALiBi bias."""
    from transformers import AutoModelForCausalLM, BloomConfig
    with pytest.raises(NotImplementedError, match="ALiBi.*no ALiBi bias.*attn_implementation='sdpa'"):
        AutoModelForCausalLM.from_config(_falcon_config(alibi=True), attn_implementation="cascade")
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2),
                                             attn_implementation="cascade").eval()
    ids, mask = padded_batch(seed=0)
    with pytest.raises(NotImplementedError, match="ALiBi.*no ALiBi bias.*attn_implementation='eager'"):
        bloom.generate(input_ids=ids % 64, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=0)


def test_alibi_falcon_built_without_the_loader_is_refused():
    """An ALiBi Falcon built by its class (not through from_config / from_pretrained) is refused too: before 5.25 by
    its table's "cascade" entry, from 5.25 (stock routes its attention) by generate, before any forward, whose first
    check is ALiBi (its forward would otherwise meet the deferred cascade mask)."""
    from transformers import FalconForCausalLM
    config = _falcon_config(alibi=True)
    config._attn_implementation = "cascade"
    ids, mask = padded_batch(seed=0)
    with pytest.raises(NotImplementedError, match="ALiBi.*no ALiBi bias.*attn_implementation='sdpa'"):
        model = FalconForCausalLM(config).eval()
        model.generate(input_ids=ids % 64, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=0)


def test_upstream_encoder_expansion_hook_still_exists():
    """The encoder output of a cascade encoder-decoder model is not expanded per beam: generate must still
    expand inputs through _expand_inputs_for_generation(expand_size=, is_encoder_decoder=, encoder_outputs=)."""
    expand = GenerationMixin.__dict__["_expand_inputs_for_generation"]
    function = expand.__func__ if isinstance(expand, staticmethod) else expand
    params = inspect.signature(inspect.unwrap(function)).parameters
    for name in ("expand_size", "is_encoder_decoder", "input_ids", "model_kwargs"):
        assert name in params, f"_expand_inputs_for_generation lost its {name!r} parameter"
    source = inspect.getsource(GenerationMixin.generate.__hf_cascade_original__)
    assert "_expand_inputs_for_generation(" in source and "is_encoder_decoder=" in source
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin
    assert "return_token_timestamps" in inspect.signature(inspect.unwrap(WhisperGenerationMixin.generate)).parameters
