"""Stock's promises at the edges of a generate call (issue 31): autocast / mixed precision, forward hooks on the model,
exceptions from a decode forward, NaN logits under sampling, user processors that replace transformers' own, train
mode. Every case runs stock sdpa with the same seed as the oracle, on the cascade's paths: transformers' loop
(``cuda_graphs=False``), the graph runner's and the whole step's eager static step (``cuda_graphs="eager"``, what a
GPU captures), and the default."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from conftest import model_pair, padded_batch

PATHS = {"default": None, "transformers-loop": dict(cuda_graphs=False), "eager-static": dict(cuda_graphs="eager")}


def _generate(model, ids, mask, path=None, seed=123, **kwargs):
    torch.manual_seed(seed)
    extra = {} if path is None else dict(hf_cascade_config=path)
    return model.generate(input_ids=ids, attention_mask=mask, **extra, **kwargs)


@pytest.fixture(scope="module")
def float32_pair():
    return model_pair("llama", dtype=torch.float32, seed=1)


# ---- autocast -------------------------------------------------------------------------------------------------------
AUTOCAST_SETTINGS = {
    "beam": dict(num_beams=4, max_new_tokens=8),
    "greedy": dict(do_sample=False, max_new_tokens=8),
    "sample": dict(do_sample=True, num_return_sequences=3, max_new_tokens=8),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("setting", sorted(AUTOCAST_SETTINGS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_autocast_gives_stock_tokens(float32_pair, dtype, setting, path):
    """A float32 model under CPU autocast (how Trainer's bf16/fp16 evaluation runs generate): K leaves rotary in
    float32, V leaves v_proj in the autocast dtype; stock's sdpa computes on both cast to it, and so does the cascade
    (one pool dtype)."""
    stock, cascade = float32_pair
    ids, mask = padded_batch(lengths=(23, 17))
    kwargs = AUTOCAST_SETTINGS[setting]
    with torch.autocast("cpu", dtype=dtype):
        want = _generate(stock, ids, mask, **kwargs)
        got = _generate(cascade, ids, mask, PATHS[path], **kwargs)
    assert torch.equal(got, want)


def test_autocast_then_not_reuses_nothing_stale(float32_pair):
    """A call under autocast, then one without, then one under it again: each gives stock's tokens (the kept decode
    state of one is not replayed by the other: its pools hold another dtype)."""
    stock, cascade = float32_pair
    ids, mask = padded_batch(lengths=(23, 17))
    for on in (True, False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            want = _generate(stock, ids, mask, num_beams=4, max_new_tokens=6)
            got = _generate(cascade, ids, mask, PATHS["eager-static"], num_beams=4, max_new_tokens=6)
        assert torch.equal(got, want), on


@pytest.mark.parametrize("beams", [2, 3, 4, 5])
def test_autocast_beam_scores_within_bf16_rounding(float32_pair, beams):
    """In bf16 the cascade's attention rounds otherwise than stock's sdpa kernel (float32 softmax and log-sum-exp
    merges), so two beams within rounding of each other may swap (3 beams here): the returned beams then score within
    rounding of stock's (measured: at most 2.8e-3 log-prob), never far off."""
    stock, cascade = float32_pair
    ids, mask = padded_batch(lengths=(23, 17))
    kwargs = dict(num_beams=beams, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _generate(stock, ids, mask, **kwargs)
        got = _generate(cascade, ids, mask, **kwargs)
    assert (got.sequences_scores - want.sequences_scores).abs().max() < 1e-2


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_autocast_encoder_decoder(family):
    from test_encoder_decoder import pair, sources
    stock, cascade = pair(family, dtype=torch.float32)
    ids, mask = sources()
    for path in PATHS.values():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = _generate(stock, ids, mask, num_beams=3, max_new_tokens=8)
            got = _generate(cascade, ids, mask, path, num_beams=3, max_new_tokens=8)
        assert torch.equal(got, want), path
