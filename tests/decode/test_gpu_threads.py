"""generate on one CUDA model from several threads at once, with the default settings: decode steps replayed as
captured CUDA graphs (the runner of each call's own thread), captures one at a time. Every threaded call gives
stock's tokens (float32, TF32 off), and afterwards ``model.forward`` is the model's own again.

In bfloat16 the threaded calls that search (beams, greedy) give the tokens of the same calls run alone. A sampling call
draws from torch's process-wide CUDA generator, so its tokens depend on the draws made before it (in another thread,
or an earlier call): with top_k=1, bfloat16 logits often tie at the top and TopK keeps every tied token, so the draw
decides between them. Stock's sampling does the same; a sampling call seeded before it runs gives its tokens again.

Run on the GPU machine: ``pytest -m gpu tests/decode/test_gpu_threads.py``.
"""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_cascade import session

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, vocab_size=500, max_position_embeddings=4096, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)
CALLS = [dict(num_beams=4, max_new_tokens=12), dict(max_new_tokens=10),
         dict(do_sample=True, top_k=1, num_return_sequences=3, max_new_tokens=9)]


def test_threads_on_one_cuda_model_give_stock_tokens():
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    models = {}
    for impl in ("sdpa", "cascade"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            models[impl] = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), attn_implementation=impl,
                                                            dtype=torch.float32).eval()
    model = models["cascade"]
    model.load_state_dict(models["sdpa"].state_dict())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (2, 96 + 16 * i), generator=g).cuda() for i in range(len(CALLS))]
    alone = [models["sdpa"].generate(ids, pad_token_id=0, **kw).cpu() for ids, kw in zip(prompts, CALLS)]
    results, errors, start = {}, [], threading.Barrier(len(CALLS) * 2)

    def body(t):
        i = t % len(CALLS)
        start.wait()
        try:
            for r in range(3):
                results[(t, r)] = model.generate(prompts[i], pad_token_id=0, **CALLS[i]).cpu()
        except BaseException as err:  # noqa: BLE001 — reported below
            errors.append(err)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(len(CALLS) * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == len(CALLS) * 2 * 3
    for (t, _), out in results.items():
        assert torch.equal(out, alone[t % len(CALLS)]), (t, CALLS[t % len(CALLS)])
    assert "forward" not in model.__dict__          # the dispatcher is gone: the class's forward again
    assert torch.equal(model.generate(prompts[0], pad_token_id=0, **CALLS[0]).cpu(), alone[0])
    session.release(model)


def test_bf16_threads_search_alike_and_sampling_follows_the_generator():
    """bfloat16 (issue 31 item 7): beam and greedy calls from six threads give the tokens the same calls give alone;
    the top_k=1 sampling call with tied top logits follows the global generator: seeded, it repeats its tokens."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**SHAPE, "vocab_size": 32000}),
                                             attn_implementation="cascade", dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (2, 300 + 170 * i), generator=g).cuda() for i in range(3)]
    calls = [dict(num_beams=4, max_new_tokens=24), dict(max_new_tokens=24),
             dict(do_sample=True, top_k=1, num_return_sequences=3, max_new_tokens=24)]

    def gen(i):
        return model.generate(prompts[i], pad_token_id=0, **calls[i]).cpu()

    alone = [gen(i) for i in range(2)]
    seeded = []
    for _ in range(2):
        session.release(model)
        torch.manual_seed(7)
        seeded.append(gen(2))
    assert torch.equal(seeded[0], seeded[1])
    results, errors, start = {}, [], threading.Barrier(6)

    def body(t):
        start.wait()
        try:
            for r in range(2):
                results[(t, r)] = gen(t % 3)
        except BaseException as err:  # noqa: BLE001 — reported below
            errors.append(err)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for (t, _), out in results.items():
        if t % 3 < 2:
            assert torch.equal(out, alone[t % 3]), (t, calls[t % 3])
    session.release(model)
