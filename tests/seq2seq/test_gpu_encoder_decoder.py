"""Encoder-decoder cross-attention on the GPU backends (run on the GPU machine: pytest -m gpu).

The cross-attention plan (groups = inputs, prefix = the input's encoder blocks, no suffix) goes
through ``backend.attend`` like any step; every backend must match a dense float32 attention of each
row over its input's real encoder tokens, and the reference backend."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import hf_cascade
from hf_cascade import cross_attention, cross_kv, seq2seq_models
from hf_cascade.config import CascadeConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class _CrossModule(nn.Module):
    """The two linears a BART/Whisper cross-attention module projects encoder states with."""

    def __init__(self, d_model, heads, head_dim):
        super().__init__()
        self.k_proj = nn.Linear(d_model, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, heads * head_dim)
        self.head_dim = head_dim


def _dense(q, states, mask, module, n, scale):
    """Each row against its input's real tokens, float32, plain softmax."""
    out = []
    for r in range(q.shape[0]):
        b = r // n
        real = states[b][mask[b].bool()].float()
        k = (real @ module.k_proj.weight.float().T).view(real.shape[0], -1, module.head_dim)
        v = (real @ module.v_proj.weight.float().T + module.v_proj.bias.float()).view(real.shape[0], -1,
                                                                                      module.head_dim)
        s = torch.einsum("qhd,khd->hqk", q[r].float(), k) * scale
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["cuda", "flashinfer"])
@pytest.mark.parametrize("heads,head_dim,lengths,beams,q_len", [
    (20, 64, (1500, 1500), 5, 1),          # whisper-large-v3 shape, 30 s audio
    (16, 64, (1024, 700, 333), 4, 1),      # bart-large-cnn shape, right-padded sources
    (16, 64, (512, 97), 4, 3),             # flan-t5-large shape; a 3-token query (a decoder prompt)
    (8, 128, (300, 1500), 2, 1),
])
def test_cross_attention_matches_dense(backend, heads, head_dim, lengths, beams, q_len):
    try:
        hf_cascade.kernels.load(backend)
    except ImportError as err:
        pytest.skip(str(err))
    torch.manual_seed(0)
    dtype, dev = torch.bfloat16, "cuda"
    d_model, width = 256, max(lengths)
    module = _CrossModule(d_model, heads, head_dim).to(dev, dtype)
    states = torch.randn(len(lengths), width, d_model, device=dev, dtype=dtype)
    mask = (torch.arange(width, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]).long()
    rows = len(lengths) * beams
    q = torch.randn(rows, heads, q_len, head_dim, device=dev, dtype=dtype)
    scale = head_dim ** -0.5
    outs = {}
    for name in (backend, "reference"):
        cache = cross_kv.CrossAttentionCache(1, CascadeConfig(backend=name))
        cache.fill([seq2seq_models.SUPPORTED["bart"].cross_projection(module)], states, mask)
        context = cross_attention.CrossContext(EncoderDecoderCache(DynamicCache(), cache))
        try:
            outs[name], _ = cross_attention.cross_attention(context, cache.layers[0], module, q, 0.0, scale, {})
        except NotImplementedError as err:     # a backend may refuse a plan with no suffix (backend="auto" moves on)
            assert name == "flashinfer" and "cannot run this step" in str(err)
            pytest.skip(str(err))
    want = _dense(q.transpose(1, 2), states, mask, module, beams, scale)
    torch.testing.assert_close(outs["reference"].float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[backend].float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[backend].float(), outs["reference"].float(), atol=1e-2, rtol=1e-2)


def test_bart_float32_beam_search_matches_stock():
    from transformers import AutoModelForSeq2SeqLM, BartConfig
    torch.backends.cuda.matmul.allow_tf32 = False
    make = lambda: BartConfig(vocab_size=1000, d_model=256, encoder_layers=2, decoder_layers=2,  # noqa: E731
                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                              decoder_ffn_dim=512, max_position_embeddings=1100, forced_bos_token_id=None,
                              forced_eos_token_id=None)
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa").cuda().eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade").cuda().eval()
    cascade.load_state_dict(stock.state_dict())
    ids = torch.randint(3, 1000, (3, 1000), device="cuda")
    mask = (torch.arange(1000, device="cuda")[None, :] < torch.tensor([[1000], [600], [123]], device="cuda")).long()
    kw = dict(num_beams=4, num_return_sequences=2, max_new_tokens=16, no_repeat_ngram_size=2)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))


def _whisper(attn, dtype=torch.float32):
    import transformers as T
    config = T.WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=256, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                             decoder_ffn_dim=512, max_source_positions=1500, max_target_positions=448,
                             pad_token_id=50257, bos_token_id=50257, eos_token_id=50257,
                             decoder_start_token_id=50258, suppress_tokens=[], begin_suppress_tokens=[])
    model = T.WhisperForConditionalGeneration._from_config(config, attn_implementation=attn,
                                                           dtype=dtype).cuda().eval()
    g = model.generation_config
    g.decoder_start_token_id, g.eos_token_id, g.pad_token_id = 50258, 50257, 50257
    g.lang_to_id, g.task_to_id = {"<|en|>": 50259}, {"transcribe": 50359, "translate": 50358}
    g.no_timestamps_token_id, g.prev_sot_token_id, g.is_multilingual = 50363, 50361, True
    g.max_initial_timestamp_index, g.suppress_tokens, g.begin_suppress_tokens = 50, [], []
    return model


def test_whisper_float32_beam_search_matches_stock(monkeypatch):
    """Whisper on the GPU: cross K/V in the paged pool layout, decoder self-attention paged (float32: the
    reference backend under "auto"), its decode steps replayed from a CUDA graph, through Whisper's own generate
    with timestamps."""
    from conftest import RunnerSpy
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    stock = _whisper("sdpa")
    cascade = _whisper("cascade")
    cascade.load_state_dict(stock.state_dict())
    features = torch.randn(3, 80, 3000, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    spy = RunnerSpy(monkeypatch)
    for kw in (dict(num_beams=5, no_repeat_ngram_size=2), dict(num_beams=4, return_timestamps=True)):
        kw = dict(kw, language="en", max_new_tokens=24)
        assert torch.equal(stock.generate(features, **kw), cascade.generate(features, **kw))
    # Whisper's generate decodes this 30 s input twice (its generate_with_fallback runs twice, stock's as well):
    # the first decode captures, the second replays the graph it kept; a runner's counters are its last decode's
    # (replays only come from a captured graph)
    runners = [r for r in spy.runners if r is not None]
    assert len(runners) == 4 and all(r.disabled is None and r.replays >= 15 for r in runners), \
        [(r.disabled, r.captures, r.replays) for r in runners]


@pytest.mark.parametrize("kw", [dict(num_beams=5, no_repeat_ngram_size=2),
                                dict(do_sample=True, num_return_sequences=3, top_k=0)], ids=["beam", "sample"])
def test_whisper_graph_replay_equals_eager_bitwise(kw, monkeypatch):
    """bf16 on the cuda kernels: the replayed decode step gives bitwise the eager static step's tokens and scores."""
    from conftest import RunnerSpy, host_loop
    torch.manual_seed(0)
    model = _whisper("cascade", torch.bfloat16)
    features = torch.randn(3, 80, 3000, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).to(
        torch.bfloat16)
    spy = RunnerSpy(monkeypatch)
    outs = []
    for mode in ("eager", True):
        torch.manual_seed(3)
        outs.append(model.generate(features, language="en", max_new_tokens=24, return_dict_in_generate=True,
                                   output_scores=True, hf_cascade_config=CascadeConfig(backend="cuda", cuda_graphs=mode),
                                   **host_loop(), **kw))       # (transformers' loop around the runner)
    eager_run, graph_run = spy.runners
    assert graph_run.disabled is None and graph_run.captures == 1 and graph_run.replays >= 15, graph_run.disabled
    a, b = outs
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert torch.equal(sa, sb)
