"""Model families: cascade generate gives stock's tokens, or refuses with a clear error.

Each family is built tiny from its config (random weights, float64) twice, with separate config
objects: once with stock attention (sdpa, or eager where the family has no sdpa) and once with
"cascade". Beam search (4 beams, 2 returned), sampling (3 returned, fixed seed) and greedy run on
a left-padded batch of two prompts. ``FAMILIES`` is the support matrix; ``tools/support_table.py``
prints it as docs/families.md's table.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM

from hf_cascade import CascadeCache
from hf_cascade.compat import FALCON_ROUTES_ATTENTION
from conftest import VOCAB, cache_kw, host_loop, padded_batch

NEW = 7            # new tokens per generate call
PROMPTS = (21, 15)  # prompt lengths of the left-padded batch; a sequence reaches at most 21 + NEW = 28 positions
MODES = ("beam", "sample", "greedy")
MODE_TITLES = {"beam": "beam search", "sample": "sampling", "greedy": "greedy"}


@dataclass(frozen=True)
class Family:
    """One row of the support matrix.

    ``make()`` returns a fresh tiny config. ``status`` is "exact" (token-exact with stock) or
    "refused" (every mode raises NotImplementedError matching ``error``, which must name stock's attention).
    ``quirks`` lists what the family exercises in the attention path (or why it is refused).
    """

    make: Callable[[], transformers.PretrainedConfig]
    status: str = "exact"
    quirks: str = ""
    error: str | None = None
    modes: tuple = MODES
    extra: dict = field(default_factory=dict)   # extra generate kwargs
    dtype: torch.dtype = torch.float64
    error_type: type = NotImplementedError
    stock: str | None = None    # stock attention to compare with; None: sdpa, or eager where the family has no sdpa
    load: dict = field(default_factory=dict)    # extra from_config kwargs, for both models
    init: Callable | None = None    # init(model): adjusts the random weights (before the cascade model copies them)


def _llama_like(cls, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=None)
    common.update(overrides)
    return lambda: cls(**common)


def _cfg(cls, **kwargs):
    kwargs = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None, **kwargs}
    return lambda: cls(**kwargs)


T = transformers


def _spread_sinks(model):
    """GPT-OSS's sinks start near 0 (std initializer_range); spread them so that dropping, repeating or
    permuting them changes the tokens."""
    for layer in model.model.layers:
        layer.self_attn.sinks.normal_(0.0, 2.0)


# transformers before ~5.2x computes GPT-J's and CodeGen's attention in their own code (patches/families.py routes it),
# with the scores in float32 whatever the model's dtype: compared in float32 there
_UNROUTED = dict(dtype=torch.float32)
_GPTJ = ({} if "ALL_ATTENTION_FUNCTIONS" in vars(importlib.import_module("transformers.models.gptj.modeling_gptj"))
         else _UNROUTED)
_CODEGEN_MODELING = importlib.import_module("transformers.models.codegen.modeling_codegen")
_CODEGEN = {} if "ALL_ATTENTION_FUNCTIONS" in vars(_CODEGEN_MODELING) else _UNROUTED


def _falcon(**overrides):
    return _cfg(T.FalconConfig, **{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "alibi": False, "max_position_embeddings": 256, **overrides})


FAMILIES: dict[str, Family] = {
    "Llama": Family(_llama_like(T.LlamaConfig), quirks="GQA 4/2, RoPE"),
    "Mistral": Family(_llama_like(T.MistralConfig, sliding_window=12),
                      quirks="sliding window 12, shorter than the sequences"),
    "Qwen2": Family(_llama_like(T.Qwen2Config, num_key_value_heads=4), quirks="MHA, q/k/v bias"),
    "Qwen3": Family(_llama_like(T.Qwen3Config, num_key_value_heads=1, head_dim=32),
                    quirks="MQA, head_dim 32 != hidden/heads, q/k norm"),
    "Gemma": Family(_llama_like(T.GemmaConfig, num_key_value_heads=1, head_dim=32), quirks="MQA, head_dim 32"),
    "Gemma2": Family(_llama_like(T.Gemma2Config, head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                 final_logit_softcapping=5.0, sliding_window=12, initializer_range=0.2,
                                 layer_types=["sliding_attention", "full_attention"]),
                     dtype=torch.float32, stock="eager",
                     quirks="logit softcap 1.0, scaling 24^-0.5, hybrid layers with sliding window 12 (stock: eager, "
                            "as stock sdpa drops the softcap; float32, as stock eager's float32 softmax turns "
                            "float64 masks into NaN)"),
    "Gemma3": Family(_llama_like(T.Gemma3TextConfig, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                                 layer_types=["sliding_attention", "full_attention"]),
                     quirks="hybrid layers, sequences inside the sliding window 64, q/k norm"),
    "Phi3": Family(_llama_like(T.Phi3Config, partial_rotary_factor=0.5), quirks="fused qkv, partial RoPE"),
    "OPT": Family(_cfg(T.OPTConfig, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                       word_embed_proj_dim=64, max_position_embeddings=256, bos_token_id=2),
                  quirks="learned positions (from the padding mask), MHA with bias"),
    "GPT-2": Family(_cfg(T.GPT2Config, n_embd=64, n_layer=2, n_head=4, n_positions=256),
                    quirks="learned positions, Conv1D qkv"),
    "GPT-2 (token types)": Family(_cfg(T.GPT2Config, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                       initializer_range=0.3),
                                  extra={"token_type_ids": torch.randint(0, 4, (2, max(PROMPTS)),
                                                                         generator=torch.Generator().manual_seed(0))},
                                  quirks="token_type_ids (embedded like tokens), prefilled per prompt"),
    "GPT-NeoX": Family(_cfg(T.GPTNeoXConfig, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=256),
                       quirks="partial RoPE, parallel residual"),
    "Falcon": Family(_falcon(multi_query=True, new_decoder_architecture=False),
                     quirks="old architecture, MQA, parallel attention/MLP, RoPE; before transformers 5.25 served "
                            "through patches/families.py (its own attention-class table and attention code)"),
    "Falcon (multi-head)": Family(_falcon(multi_query=False, new_decoder_architecture=False, parallel_attn=False),
                                  quirks="old architecture, MHA, sequential attention/MLP, RoPE"),
    "Falcon (new architecture)": Family(_falcon(new_decoder_architecture=True, num_kv_heads=2),
                                        quirks="new decoder architecture, GQA 4/2 (stock caches K/V broadcast to "
                                               "every head before 5.25; we store the 2), two layer norms"),
    "Falcon (new architecture, MQA)": Family(_falcon(new_decoder_architecture=True, num_kv_heads=1,
                                                     num_ln_in_parallel_attn=1),
                                             quirks="new decoder architecture, MQA, one layer norm"),
    "Falcon (ALiBi)": Family(_falcon(alibi=True), status="load error", error_type=NotImplementedError,
                             error="ALiBi.*no ALiBi bias.*attn_implementation='sdpa'",
                             quirks="ALiBi: the cascade kernels have no ALiBi bias; refused at load, told to load sdpa "
                                    "(or a RoPE Falcon)"),
    "StableLM": Family(_llama_like(T.StableLmConfig, partial_rotary_factor=0.25, use_qkv_bias=True),
                       quirks="partial RoPE, qkv bias; AttentionInterface without transformers' "
                              "_supports_attention_backend flag"),
    "OLMo2": Family(_llama_like(T.Olmo2Config), quirks="q/k norm over all heads"),
    "Granite": Family(_llama_like(T.GraniteConfig, attention_multiplier=0.3, embedding_multiplier=2.0,
                                  residual_multiplier=0.5, logits_scaling=2.0),
                      quirks="attention scaling 0.3 (attention_multiplier)"),
    "Cohere": Family(_llama_like(T.CohereConfig, use_qk_norm=True, logit_scale=0.5), quirks="q/k norm, parallel block"),
    "Phi": Family(_cfg(T.PhiConfig, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       partial_rotary_factor=0.5, qk_layernorm=True, max_position_embeddings=256),
                  quirks="partial RoPE, q/k layernorm"),
    "GPT-J": Family(_cfg(T.GPTJConfig, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256),
                    **{"quirks": "interleaved partial RoPE (transformers 5.17: own attention-class table and "
                                 "attention code, routed by patches/families.py; float32 there)", **_GPTJ}),
    "OLMo": Family(_llama_like(T.OlmoConfig, clip_qkv=0.5), quirks="clipped qkv"),
    "Starcoder2": Family(_cfg(T.Starcoder2Config, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                              max_position_embeddings=256),
                         quirks="GQA, bias, sliding window 16"),
    "Mixtral": Family(_llama_like(T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
                      dtype=torch.float32, quirks="MoE MLP (float32: stock's grouped_mm has no float64)"),
    "Cohere2": Family(_llama_like(T.Cohere2Config, sliding_window=12,
                                  layer_types=["sliding_attention", "full_attention"]),
                      quirks="hybrid layers, sliding window 12 (RoPE on sliding layers only)"),
    "SmolLM3": Family(_llama_like(T.SmolLM3Config, no_rope_layers=[1, 0]), quirks="NoPE layers"),
    "GPT-BigCode": Family(_cfg(T.GPTBigCodeConfig, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                               multi_query=True), quirks="MQA, learned positions"),
    "GPT-OSS": Family(_llama_like(T.GptOssConfig, head_dim=16, sliding_window=12, initializer_range=0.2,
                                  layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                                  num_experts_per_tok=2, rope_parameters=dict(
                                      rope_type="yarn", factor=2.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=128, rope_theta=150000.0)),
                      load=dict(experts_implementation="eager"), init=_spread_sinks,
                      quirks="attention sinks (s_aux, spread to std 2), hybrid layers with sliding window 12, MoE MLP (stock: eager, "
                             "as it has no sdpa; experts in eager, as stock's grouped_mm has no float64)"),
    "Mamba": Family(_cfg(T.MambaConfig, hidden_size=32, num_hidden_layers=2, state_size=4), status="refused",
                    error="no attention layers", quirks="state-space model: no attention, told to load eager"),
    "Bloom": Family(_cfg(T.BloomConfig, hidden_size=64, n_layer=2, n_head=4), status="refused",
                    error="ALiBi.*no ALiBi bias",
                    quirks="ALiBi (the cascade kernels have no ALiBi bias), own attention code: told to load eager"),
    "MPT": Family(_cfg(T.MptConfig, d_model=64, n_layers=2, n_heads=4, max_seq_len=256), status="refused",
                  error="ALiBi.*no ALiBi bias",
                  quirks="ALiBi (the cascade kernels have no ALiBi bias), own attention code: told to load eager"),
    "CodeGen": Family(_cfg(T.CodeGenConfig, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256, n_ctx=256),
                      **{"quirks": "interleaved partial RoPE, fused qkv (transformers 5.17: own attention code, "
                                   "routed by patches/families.py; float32 there)", **_CODEGEN}),
    "GPT-Neo": Family(_cfg(T.GPTNeoConfig, hidden_size=64, num_layers=2, num_heads=4, window_size=12,
                           attention_types=[[["global", "local"], 1]], max_position_embeddings=256,
                           initializer_range=0.2),
                      dtype=torch.float32,
                      quirks="unscaled scores (weights spread to std 0.2), local layers with window 12, shorter than "
                             "the sequences; own "
                             "attention-class table and attention code, routed by patches/families.py (stock: eager, "
                             "as it has no sdpa; float32, as stock computes the scores in float32)"),
    "XGLM": Family(_cfg(T.XGLMConfig, d_model=64, num_layers=2, attention_heads=4, ffn_dim=96,
                        max_position_embeddings=256, decoder_start_token_id=1), dtype=torch.float32,
                   quirks="sinusoidal positions (from the padding mask), query scaled before the product; own "
                          "attention code, routed by patches/families.py (float32: stock's masking fails in float64)"),
    "GPT-NeoX-Japanese": Family(_cfg(T.GPTNeoXJapaneseConfig, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_multiple_size=2, max_position_embeddings=256),
                                status="refused", error="computes attention in its own code",
                                quirks="own attention code: told to load eager"),
}


def stock_attention(model_class) -> str:
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


@functools.lru_cache(maxsize=1)
def model_pair(name: str):
    """(stock model, cascade model) of family ``name``, same random weights, float64, eval mode."""
    family = FAMILIES[name]
    torch.manual_seed(0)
    config = family.make()
    model_class = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    stock = AutoModelForCausalLM.from_config(config, attn_implementation=family.stock or stock_attention(model_class),
                                             dtype=family.dtype, **family.load).eval()
    if family.init is not None:
        with torch.no_grad():
            family.init(stock)
    cascade = AutoModelForCausalLM.from_config(family.make(), attn_implementation="cascade",
                                               dtype=family.dtype, **family.load).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def generate_kwargs(mode: str) -> dict:
    common = dict(max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    if mode == "beam":
        return dict(common, num_beams=4, num_return_sequences=2, length_penalty=0.7)
    if mode == "sample":
        return dict(common, do_sample=True, num_return_sequences=3, top_k=0, temperature=1.5)
    return dict(common, do_sample=False)


def run(model, mode, ids, mask, **extra):
    torch.manual_seed(123)
    return model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs(mode), **extra)


CASES = [pytest.param(name, mode, id=f"{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}-{mode}")
         for name, family in FAMILIES.items() for mode in family.modes]


@pytest.mark.parametrize("name,mode", CASES)
def test_family(name, mode):
    family = FAMILIES[name]
    if family.status == "load error":
        with pytest.raises(family.error_type, match=family.error):
            model_pair(name)
        return
    stock, cascade = model_pair(name)
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    if family.status == "refused":
        with pytest.raises(NotImplementedError, match=family.error) as err:
            run(cascade, mode, ids, mask, **family.extra)
        assert f"attn_implementation='{stock.config._attn_implementation}'" in str(err.value)
        return
    expected = run(stock, mode, ids, mask, **family.extra)
    # greedy has nothing to share here and would run on stock's path: a CascadeCache of our own keeps it cascade
    forced = cache_kw(cascade, CascadeCache(cascade.config)) if mode == "greedy" else {}
    got = run(cascade, mode, ids, mask, **family.extra, **forced)
    assert expected.shape == got.shape
    assert torch.equal(expected, got), f"{name} {mode}: cascade tokens differ from stock"


# families served through patches/families.py's attention modules on this transformers (GPT-J and CodeGen: 5.17;
# Falcon: before 5.25)
_ROUTED_UPSTREAM = {"GPT-J": not _GPTJ, "CodeGen": not _CODEGEN, "Falcon": FALCON_ROUTES_ATTENTION}
PATCHED = [name for name, family in FAMILIES.items()
           if family.status == "exact" and ("patches/families.py" in family.quirks or name.startswith("Falcon"))
           and not _ROUTED_UPSTREAM.get(name.split(" (")[0])]


@pytest.mark.parametrize("name", PATCHED)
def test_patched_family_on_the_graph_runner(name, monkeypatch):
    """On the GPU decode steps are replayed from a captured graph: the runner's static path (cuda_graphs="eager": the
    same fixed inputs and buffers, replayed without capture) gives stock's beams for these modules too."""
    from conftest import RunnerSpy
    spy = RunnerSpy(monkeypatch)
    stock, cascade = model_pair(name)
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    expected = run(stock, "beam", ids, mask)
    got = run(cascade, "beam", ids, mask, hf_cascade_config=dict(cuda_graphs="eager"), **host_loop())
    assert torch.equal(expected, got)
    assert spy.runners and spy.runners[-1] is not None and spy.runners[-1].replays > 0


def test_table_is_consistent():
    for name, family in FAMILIES.items():
        assert family.status in ("exact", "refused", "load error"), name
        assert (family.error is not None) == (family.status != "exact"), name


def test_the_docs_show_this_matrix():
    """docs/families.md's table is tools/support_table.py's output for FAMILIES as they stand (rerun
    ``python tools/docs_pages.py`` when a family changes). The page shows the newest transformers' matrix (5.17 tests
    two families in float32)."""
    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip("the docs' table is made on transformers >= 5.24")
    root = pathlib.Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("support_table", root / "tools" / "support_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.table() in (root / "docs" / "families.md").read_text(encoding="utf-8")


def test_refusals_name_an_attention_the_model_has():
    """GPT-OSS has no sdpa (sdpa cannot add sinks): a refusal tells its users to load eager, Llama's sdpa."""
    from hf_cascade.attention import stock_attention as named
    for name, expected in (("GPT-OSS", "eager"), ("Llama", "sdpa")):
        config = FAMILIES[name].make()
        config.attention_dropout = 0.5          # refused in training mode: the cascade's dropout is not stock's
        model = AutoModelForCausalLM.from_config(config, attn_implementation="cascade", dtype=torch.float32,
                                                 **FAMILIES[name].load).train()
        assert named(model.model.layers[0].self_attn) == expected
        ids, mask = padded_batch(seed=3, lengths=PROMPTS)
        with pytest.raises(ValueError, match=f"dropout active.*model.eval.*attn_implementation='{expected}'"):
            run(model, "beam", ids, mask)


def test_gpt_oss_forward_without_cache_is_stock_eager():
    """No cascade cache (a loss pass): the dense path runs the model's own eager attention, sinks included."""
    stock, cascade = model_pair("GPT-OSS")
    ids, mask = padded_batch(seed=4, lengths=PROMPTS)
    with torch.no_grad():
        expected = stock(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = cascade(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(expected, got)
