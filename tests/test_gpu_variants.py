"""End to end on the GPU: models whose layers need the kernels' variants run through backend="cuda" and agree
with backend="reference" (the same cascade path, the PyTorch kernels).

A Mistral-shaped model (sliding window shorter than the sequences, GQA, head_dim 64) and a Gemma-2-shaped one
(logit softcap, hybrid sliding / full layers, head_dim 128), tiny (2 layers, random weights), bf16:

* greedy generate: the same tokens as the reference backend until the first step where the reference's own
  top two log-probs are within bf16 noise of each other (a near tie may flip); until there, the log-probs agree;
* teacher forcing on a long shared prompt (8 beams of a 2k-token prompt, so that the beams read the prompt once
  through the prefix kernel, which then skips whole chunks outside the window): the log-probs of a tail of tokens
  agree between the two backends.

Run on the GPU machine:  PYTHONPATH=. python -m pytest -q -m gpu tests/test_gpu_variants.py
"""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import hf_cascade
from conftest import cache_kw

pytestmark = pytest.mark.gpu

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=None)
SHAPES = {
    "Mistral": lambda window: transformers.MistralConfig(**COMMON, head_dim=64, sliding_window=window),
    "Gemma2": lambda window: transformers.Gemma2Config(
        **COMMON, head_dim=128, query_pre_attn_scalar=128, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
        sliding_window=window, initializer_range=0.2, layer_types=["sliding_attention", "full_attention"]),
}
LP_TOL = 0.1       # |log-prob difference| of bf16 through 2 layers, two kernel implementations ...


def tolerance(lp_ref):
    """... plus 3 units in the last place of bf16 at each log-prob (the logits are rounded to bf16: near 30,
    Gemma-2's final softcap, one step is 0.125), elementwise."""
    return LP_TOL + 3 * torch.exp2(lp_ref.abs().clamp_min(1.0).log2().floor() - 7)


def largest_excess(lp, lp_ref) -> float:
    """max of |lp - lp_ref| - tolerance: < 0 when every log-prob agrees."""
    return ((lp - lp_ref).abs() - tolerance(lp_ref)).max().item()


def _model(name, window):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(SHAPES[name](window), attn_implementation="cascade",
                                                 dtype=torch.bfloat16)
    return model.eval()


def _greedy(model, ids, mask, backend, new):
    # an explicit cache: greedy decoding of unrelated prompts would otherwise run on stock's own path; no graphs,
    # so that every step's attention call is seen (a replayed graph launches the kernels without Python)
    cache = hf_cascade.CascadeCache(model.config, hf_cascade.CascadeConfig(backend=backend, cuda_graphs=False))
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0,
                         eos_token_id=None, return_dict_in_generate=True, output_logits=True, **cache_kw(model, cache))
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float().log_softmax(-1)


def _count_cuda_layers(monkeypatch) -> list:
    """Every layer the cuda backend serves, with its (window, softcap)."""
    from hf_cascade.kernels import cuda as cuda_backend
    calls, real = [], cuda_backend.CudaBackend.forward

    def counted(self, q, pool, metadata, params):
        calls.append((params.window, params.softcap))
        return real(self, q, pool, metadata, params)

    monkeypatch.setattr(cuda_backend.CudaBackend, "forward", counted)
    return calls


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_generate_cuda_equals_reference(name, monkeypatch):
    window = 48
    model = _model(name, window)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (3, 150), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0                                  # left padding: rows of different lengths
    mask[2, :100] = 0                                 # a row whose sequence crosses the window during decode
    ids, mask = ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()
    new = 40
    want, lp_ref = _greedy(model, ids, mask, "reference", new)
    calls = _count_cuda_layers(monkeypatch)
    got, lp_cuda = _greedy(model, ids, mask, "cuda", new)
    # the decode steps ran on the cuda kernels, windowed layers (and for Gemma-2 softcapped ones) among them
    assert sum(w is not None for w, _ in calls) >= new - 1
    assert name != "Gemma2" or sum(c is not None for _, c in calls) >= 2 * (new - 1)
    assert torch.isfinite(lp_cuda).all()
    same_steps = 0
    for r in range(ids.shape[0]):
        differ = (want[r] != got[r]).nonzero()
        first = int(differ[0]) if differ.numel() else new
        same_steps += first
        # until the first different token both ran on the same inputs: their log-probs agree
        excess = largest_excess(lp_cuda[r, : first + 1], lp_ref[r, : first + 1])
        assert excess < 0, (name, r, excess)
        if first < new:                                  # a flip only where the reference itself nearly ties
            top2 = lp_ref[r, first].topk(2).values
            assert (top2[0] - top2[1]) < 2 * tolerance(top2[0]), (name, r, first, top2.tolist())
    assert same_steps >= new * ids.shape[0] // 2, "most greedy tokens must agree"


@pytest.mark.parametrize("name", list(SHAPES))
def test_teacher_forced_long_shared_prompt(name, monkeypatch):
    # 8 beams of one 2k-token prompt (7 x 2k shared-token reads saved: a cascade for the cuda backend too), window
    # 500: the prefix kernel reads the prompt once for all beams and skips its chunks before the window; then a
    # 24-token tail per beam (queries of 24 tokens, causal inside the tail) and one decode step
    model = _model(name, 500)
    ids = torch.randint(2, VOCAB, (1, 2000), generator=torch.Generator().manual_seed(2)).cuda()
    beams = 8
    tail = torch.randint(2, VOCAB, (beams, 25), generator=torch.Generator().manual_seed(3)).cuda()
    lps = {}
    calls = _count_cuda_layers(monkeypatch)
    for backend in ("reference", "cuda"):
        cache = hf_cascade.CascadeCache(model.config, hf_cascade.CascadeConfig(backend=backend))
        with torch.no_grad():
            hf_cascade.prefill(model, cache, ids)
            cache.batch_repeat_interleave(beams)
            pos = torch.arange(ids.shape[1], ids.shape[1] + 24, device="cuda").expand(beams, -1)
            a = model(input_ids=tail[:, :24], position_ids=pos, use_cache=True, **cache_kw(model, cache)).logits
            pos = torch.full((beams, 1), ids.shape[1] + 24, device="cuda")
            b = model(input_ids=tail[:, 24:], position_ids=pos, use_cache=True, **cache_kw(model, cache)).logits
        lps[backend] = torch.cat([a, b], 1).float().log_softmax(-1)
    assert len(calls) == 2 * model.config.num_hidden_layers and any(w for w, _ in calls)   # tail, decode step
    assert torch.isfinite(lps["cuda"]).all()
    diff = (lps["cuda"] - lps["reference"]).abs().max().item()
    print(f"\n{name}: largest |log-prob difference| cuda vs reference over {beams} x 25 positions = {diff:.4f}")
    assert largest_excess(lps["cuda"], lps["reference"]) < 0, diff
