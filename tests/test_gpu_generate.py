"""End to end on the GPU, Llama-3.2-1B-shaped random model (run on the GPU machine: pytest -m gpu)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_cascade
from conftest import cache_kw

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def model_1b():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    return model.eval()


def _prompts(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128000, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1:, : length // 3] = 0                      # a left-padded second prompt
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


def test_float32_beam_search_matches_stock(model_1b):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ids, mask = _prompts(2, 600)
    kw = dict(num_beams=4, num_return_sequences=2, max_new_tokens=24, pad_token_id=0)
    model_1b.set_attn_implementation("sdpa")
    expected = model_1b.generate(input_ids=ids, attention_mask=mask, **kw)
    model_1b.set_attn_implementation("cascade")
    got = model_1b.generate(input_ids=ids, attention_mask=mask, **kw)
    model_1b.set_attn_implementation("sdpa")
    assert torch.equal(expected, got)


@pytest.mark.parametrize("backend", ["auto", "reference", "cuda", "flashinfer"])
def test_bf16_teacher_forced_logprobs_match_stock(model_1b, backend):
    """Stock's beam outputs, scored through the cascade path (prefix once, fork, tail of q>1 tokens)."""
    if backend not in ("auto", "reference"):
        try:
            hf_cascade.kernels.load(backend)
        except ImportError as err:
            pytest.skip(str(err))
    model = model_1b.to(torch.bfloat16)
    try:
        torch.manual_seed(1)
        ids = torch.randint(1, 128000, (1, 2000), generator=torch.Generator().manual_seed(3)).cuda()
        beams, new = 8, 32
        model.set_attn_implementation("sdpa")
        seqs = model.generate(input_ids=ids, num_beams=beams, num_return_sequences=beams, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0)
        with torch.no_grad():
            ref = model(input_ids=seqs).logits[:, ids.shape[1] - 1:-1].float().log_softmax(-1)
            model.set_attn_implementation("cascade")
            cache = hf_cascade.CascadeCache(model.config, hf_cascade.CascadeConfig(backend=backend))
            hf_cascade.prefill(model, cache, ids[:, :-1])
            cache.batch_repeat_interleave(beams)
            tail = seqs[:, ids.shape[1] - 1:-1]
            pos = torch.arange(ids.shape[1] - 1, seqs.shape[1] - 1, device="cuda").expand(beams, -1)
            got = model(input_ids=tail, position_ids=pos, use_cache=True, **cache_kw(model, cache)).logits.float()
            got = got.log_softmax(-1)
        target = seqs[:, ids.shape[1]:]
        lp_ref = ref.gather(-1, target[..., None]).squeeze(-1)
        lp_got = got.gather(-1, target[..., None]).squeeze(-1)
        diff = (lp_ref - lp_got).abs().max().item()
        print(f"\nbackend {backend}: largest |logprob difference| over {target.numel()} tokens = {diff:.4f}")
        assert torch.isfinite(lp_got).all()
        assert diff < 0.25, diff         # bf16 through 16 layers: both paths round differently
        assert (lp_ref.sum(-1) - lp_got.sum(-1)).abs().max().item() < 0.05 * new
        cache.reset()
    finally:
        model.to(torch.float32)
        model.set_attn_implementation("sdpa")
