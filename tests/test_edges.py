"""Stock's promises at the edges of a generate call (issue 31): autocast / mixed precision, forward hooks on the model,
exceptions from a decode forward, NaN logits under sampling, user processors that replace transformers' own, train
mode. Every case runs stock sdpa with the same seed as the oracle, on the cascade's paths: transformers' loop
(``cuda_graphs=False``), the graph runner's and the whole step's eager static step (``cuda_graphs="eager"``, what a
GPU captures), and the default."""
from __future__ import annotations

import pytest
import torch

from hf_cascade.context import UPDATE_PASSES_KWARGS    # (transformers >= 5.24)
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


# ---- forward hooks ----------------------------------------------------------------------------------------------------
class _Hooks:
    """Hooks that count, edit and record, put on a model (or one of its layers) and removed after."""

    def __init__(self, module, edit_logits=False, pre=False, layer=None):
        self.calls, self.handles = 0, []
        target = module if layer is None else module.model.layers[layer]

        def count(mod, args, kwargs, out):
            self.calls += 1
            if edit_logits:      # a logit bias by hook: token 5 always wins
                out.logits[..., 5] += 1e3
            return out

        def edit_hidden(mod, args, out):      # a steering hook on a layer: scale its output
            self.calls += 1
            hidden = out[0] if isinstance(out, tuple) else out
            return (hidden * 1.5, *out[1:]) if isinstance(out, tuple) else hidden * 1.5

        def count_pre(mod, args, kwargs):
            self.calls += 1
            return None

        if layer is not None:
            self.handles.append(target.register_forward_hook(edit_hidden))
        elif pre:
            self.handles.append(target.register_forward_pre_hook(count_pre, with_kwargs=True))
        else:
            self.handles.append(target.register_forward_hook(count, with_kwargs=True))

    def remove(self):
        for h in self.handles:
            h.remove()


HOOKS = {"count": dict(), "edit-logits": dict(edit_logits=True), "pre": dict(pre=True), "layer": dict(layer=1)}


@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("setting", ["beam", "greedy", "sample"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_forward_hooks_run_every_step(hook, setting, path):
    """A hook on the model runs once per chosen token, as stock's (its prefill and each decode step), and what it does
    to the logits chooses the tokens; a hook on a layer edits every step's activations (the step then runs eagerly:
    a captured graph would not run it)."""
    stock, cascade = model_pair("llama", seed=2)
    ids, mask = padded_batch(lengths=(23, 17))
    kwargs = {**AUTOCAST_SETTINGS[setting], "max_new_tokens": 7}
    results = []
    for model, p in ((stock, None), (cascade, PATHS[path])):
        hooks = _Hooks(model, **HOOKS[hook])
        try:
            results.append((_generate(model, ids, mask, p, **kwargs), hooks.calls))
        finally:
            hooks.remove()
    (want, want_calls), (got, got_calls) = results
    assert torch.equal(got, want)
    if hook == "edit-logits":
        assert bool((want[:, -7:] == 5).all())
    if hook != "layer":        # a layer's hook also runs in the cascade's once-per-prompt prefill forward
        assert got_calls == want_calls
    else:
        assert got_calls >= want_calls


def test_a_raising_hook_raises_once_and_leaves_the_model_usable():
    stock, cascade = model_pair("llama", seed=2)
    ids, mask = padded_batch(lengths=(23, 17))
    calls = []

    def boom(mod, args, out):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("from the hook")
        return out

    for p in PATHS.values():
        calls.clear()
        handle = cascade.register_forward_hook(boom)
        try:
            with pytest.raises(KeyError, match="from the hook"):
                _generate(cascade, ids, mask, p, num_beams=3, max_new_tokens=6)
        finally:
            handle.remove()
        assert len(calls) == 3
        assert torch.equal(_generate(cascade, ids, mask, p, num_beams=3, max_new_tokens=6),
                           _generate(stock, ids, mask, num_beams=3, max_new_tokens=6))


# ---- exceptions from a decode forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(PATHS) + ["eager-static-compiled"])
def test_an_error_inside_a_decode_forward_propagates_once(path, caplog):
    """An exception raised inside the model's forward in a decode step (here a layer's hook, at its 4th call) reaches
    the caller unchanged, once, with no step re-run (the hook ran 4 times), nothing logged as a compile failure; the
    model and a fresh call are fine after it."""
    from hf_cascade import CascadeConfig
    stock, cascade = model_pair("llama", seed=2)
    ids, mask = padded_batch(lengths=(23, 17))
    config = (CascadeConfig(cuda_graphs="eager", compile=True) if path == "eager-static-compiled" else PATHS[path])
    calls = []

    class StepFailed(Exception):
        pass

    def boom(mod, args, out):
        calls.append(1)
        if len(calls) == 4:
            raise StepFailed("inside the forward")
        return out

    handle = cascade.model.layers[0].register_forward_hook(boom)
    try:
        with pytest.raises(StepFailed, match="inside the forward"):
            _generate(cascade, ids, mask, config, num_beams=3, max_new_tokens=8)
    finally:
        handle.remove()
    assert len(calls) == 4
    assert not [r for r in caplog.records if "fail" in r.getMessage() and "compile" in r.getMessage()]
    assert torch.equal(_generate(cascade, ids, mask, config, num_beams=3, max_new_tokens=8),
                       _generate(stock, ids, mask, num_beams=3, max_new_tokens=8))


@pytest.mark.parametrize("where", ["runner", "whole-step"])
def test_an_error_of_an_uncompiled_static_step_is_not_called_a_compile_failure(where, monkeypatch, caplog):
    """The eager static step (no hooks, so the whole step or the runner serves it) raising from the attention kernel
    at its 3rd decode call: raised once, never retried as "compile failed"."""
    from hf_cascade.kernels import reference
    stock, cascade = model_pair("llama", seed=2)
    ids, mask = padded_batch(lengths=(23, 17))
    real, calls = reference.BACKEND.forward, []

    def failing(q, pool, metadata, params):
        if q.shape[1] == 1:                 # decode steps only
            calls.append(1)
            if len(calls) == 3 * cascade.config.num_hidden_layers:
                raise FloatingPointError("kernel")
        return real(q, pool, metadata, params)

    monkeypatch.setattr(reference.BACKEND, "forward", failing)
    extra = dict(return_dict_in_generate=True, output_scores=True) if where == "runner" else {}
    with pytest.raises(FloatingPointError, match="kernel"):
        _generate(cascade, ids, mask, PATHS["eager-static"], num_beams=3, max_new_tokens=8, **extra)
    assert len(calls) == 3 * cascade.config.num_hidden_layers
    assert not [r for r in caplog.records if "fail" in r.getMessage()]


# ---- NaN and -inf under sampling -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["nan", "-inf"])
@pytest.mark.parametrize("setting", ["sample", "beam-sample"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_sampling_from_nan_or_all_minus_inf_raises_stocks_error(bad, setting, path, runner_spy):
    """From the 3rd step on the logits are NaN or all -inf (a hook on lm_head: the whole step still serves the call,
    eagerly): stock's torch.multinomial raises; so does the cascade (a flag read with the finished flag), never
    returning token 0 for every row."""
    stock, cascade = model_pair("llama", seed=2)
    ids, mask = padded_batch(lengths=(23, 17))
    kwargs = (dict(do_sample=True, num_return_sequences=2) if setting == "sample"
              else dict(do_sample=True, num_beams=3))
    errors = []
    for model, p in ((stock, None), (cascade, PATHS[path])):
        calls = []

        def poison(mod, args, out):
            calls.append(1)
            return out.fill_(float(bad)) if len(calls) >= 3 else out

        handle = model.lm_head.register_forward_hook(poison)
        try:
            with pytest.raises(RuntimeError) as err:
                _generate(model, ids, mask, p, max_new_tokens=8, **kwargs)
            errors.append(str(err.value))
        finally:
            handle.remove()
    assert "probability tensor contains either `inf`, `nan` or element < 0" in errors[0]
    assert "probability tensor contains either `inf`, `nan` or element < 0" in errors[1]
    if path == "eager-static":
        assert sum(r.device_steps for r in runner_spy.runners if r is not None) > 0


def test_nan_after_the_call_finished_changes_nothing(runner_spy):
    """Steps the device queues after every row finished (up to CHECK_EVERY - 1) do not count: NaN logits there raise
    nothing, as stock never runs those steps. From lm_head's 3rd call eos wins (every row ends), from its 5th the
    logits are NaN. (Counted over lm_head's calls on all 4 rows: the cascade's own prefill runs on each prompt once.)"""
    stock, cascade = model_pair("llama", seed=2)
    ids, mask = padded_batch(lengths=(23, 17))
    kwargs = dict(do_sample=True, num_return_sequences=2, max_new_tokens=20, eos_token_id=3, pad_token_id=0)
    outs = []
    for model, p in ((stock, None), (cascade, PATHS["eager-static"])):
        calls = []

        def end_then_poison(mod, args, out):
            if out.shape[0] != 4:
                return out
            calls.append(1)
            if len(calls) >= 5:
                return out.fill_(float("nan"))
            if len(calls) >= 3:
                out[..., 3] += 1e3
            return out

        handle = model.lm_head.register_forward_hook(end_then_poison)
        try:
            outs.append(_generate(model, ids, mask, p, **kwargs))
        finally:
            handle.remove()
    assert torch.equal(outs[1], outs[0])
    assert sum(r.device_steps for r in runner_spy.runners if r is not None) > 0


# ---- a user's processor in place of transformers' own --------------------------------------------------------------
@pytest.mark.skipif(not UPDATE_PASSES_KWARGS, reason="transformers < 5.24 refuses a user processor of a default type")
@pytest.mark.parametrize("ignore", [None, 5, "tensor"])
@pytest.mark.parametrize("setting", ["greedy", "sample", "beam"])
def test_a_users_repetition_penalty_is_compared_field_by_field(ignore, setting, runner_spy):
    """A RepetitionPenaltyLogitsProcessor of the user's with the config's penalty (transformers 5.24 puts it in place
    of its own) but its own prompt_ignore_length: stock's tokens, from the whole step's loop; the device choice serves
    it only where every field is what it reproduces, the host chooser (hf_cascade.host_select) otherwise."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
    from hf_cascade import device_select
    stock, cascade = model_pair("llama", seed=3)
    ids, mask = padded_batch(lengths=(23, 17))
    kwargs = {**AUTOCAST_SETTINGS[setting], "max_new_tokens": 10, "repetition_penalty": 1.5}
    rows = ids.shape[0] * (4 if setting == "beam" else 3 if setting == "sample" else 1)
    if ignore == "tensor":
        ignore = torch.tensor([1, 4] * (rows // 2))
    processor = RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=ignore)
    outs = [_generate(model, ids, mask, p, logits_processor=LogitsProcessorList([processor]), **kwargs)
            for model, p in ((stock, None), (cascade, PATHS["eager-static"]))]
    assert torch.equal(outs[1], outs[0])
    starts = device_select.penalty_start(mask.repeat_interleave(rows // 2, 0), rows, "cpu")
    same = ignore is None and not bool(starts.any())
    assert sum(r.device_steps for r in runner_spy.runners if r is not None) > 0
    assert isinstance(runner_spy.runners[-1].whole_step_kept.state, device_select.SelectionState) == same


def test_a_processor_with_an_attribute_the_device_does_not_know_is_refused():
    """A field that a newer transformers adds to a default processor (not compared: it could change the result)
    keeps the call's token choice off the device (on the host: hf_cascade.host_select)."""
    from transformers import TemperatureLogitsWarper
    from hf_cascade.device_select import SelectionConfig, UnsupportedSelection
    from transformers import GenerationConfig
    warper = TemperatureLogitsWarper(0.7)
    warper.new_field = 3
    config = SelectionConfig.from_generation_config(GenerationConfig(do_sample=True, temperature=0.7, max_length=9),
                                                    1, 4)
    with pytest.raises(UnsupportedSelection, match="new_field"):
        config.check_against([warper], [])
    del warper.new_field
    config.check_against([warper], [])


# ---- train mode -------------------------------------------------------------------------------------------------------
def test_train_mode_with_dropout_is_refused_with_the_fix():
    from test_encoder_decoder import pair, sources
    stock, cascade = model_pair("llama", seed=2, attention_dropout=0.0)
    ids, mask = padded_batch(lengths=(23, 17))
    cascade.train()                            # Llama has no residual dropout: nothing is active, stock's tokens
    try:
        assert torch.equal(_generate(cascade, ids, mask, num_beams=3, max_new_tokens=5),
                           _generate(stock, ids, mask, num_beams=3, max_new_tokens=5))
        cascade.model.layers[0].mlp.register_module("drop", torch.nn.Dropout(0.1))    # a PEFT-like dropout
        with pytest.raises(ValueError, match=r"training mode with dropout active \(model\.layers\.0\.mlp\.drop.*"
                                             r"model\.eval\(\)"):
            _generate(cascade, ids, mask, num_beams=3, max_new_tokens=5)
        del cascade.model.layers[0].mlp.drop
    finally:
        cascade.eval()
    stock, bart = pair("bart", dtype=torch.float32)       # BART applies config.dropout functionally
    src, src_mask = sources()
    bart.train()
    try:
        with pytest.raises(ValueError, match=r"config\.dropout=0\.1.*model\.eval\(\)"):
            _generate(bart, src, src_mask, num_beams=2, max_new_tokens=4)
    finally:
        bart.eval()
    assert torch.equal(_generate(bart, src, src_mask, num_beams=2, max_new_tokens=4),
                       _generate(stock, src, src_mask, num_beams=2, max_new_tokens=4))


@pytest.mark.parametrize("family", ["bart", "t5", "whisper"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_hooks_on_an_encoder_decoder_run_once_per_chosen_token(family, path):
    """Whisper's decoder prompt (several tokens) is prefilled once per input without the model's hooks: the hook sees
    stock's count; tokens are stock's."""
    from test_encoder_decoder import _SHORT, pair, sources, whisper_pair
    if family == "whisper":
        stock, cascade = whisper_pair()
        inputs, kwargs = dict(input_features=_SHORT), dict(language="en", num_beams=3, max_new_tokens=6)
    else:
        stock, cascade = pair(family)
        ids, mask = sources()
        inputs, kwargs = dict(input_ids=ids, attention_mask=mask), dict(num_beams=3, max_new_tokens=6)
    results = []
    for model, p in ((stock, None), (cascade, PATHS[path])):
        calls = []
        handle = model.register_forward_hook(lambda *a: calls.append(1))
        try:
            torch.manual_seed(5)
            out = model.generate(**inputs, **kwargs, **({} if p is None else dict(hf_cascade_config=p)))
        finally:
            handle.remove()
        results.append((out, len(calls)))
    assert torch.equal(results[1][0], results[0][0])
    assert results[1][1] == results[0][1]


# ---- a padded batch of one-token prompts -----------------------------------------------------------------------------
@pytest.mark.parametrize("outputs", [False, True], ids=["tokens", "return-dict"])
@pytest.mark.parametrize("setting", ["beam", "greedy", "sample"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_one_real_token_per_prompt_left_padded(outputs, setting, path):
    """Every prompt of the batch is one token after left padding: the prefill stores nothing and the first decode
    step's keys are its own tokens alone. The graph runner begins that step before the forward, so the forward's mask
    must not count its tokens twice (it did: the first step attended to a pad column, other tokens than stock)."""
    stock, cascade = model_pair("llama")
    ids = torch.tensor([[0, 0, 0, 5], [0, 0, 0, 7]])
    mask = (ids != 0).long()
    kwargs = {**AUTOCAST_SETTINGS[setting], "max_new_tokens": 6}
    if outputs:
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    want, got = (_generate(m, ids, mask, p, **kwargs) for m, p in ((stock, None), (cascade, PATHS[path])))
    if outputs:
        want, got = want.sequences, got.sequences
    assert torch.equal(got, want)


def test_one_real_token_per_prompt_on_a_cascade_cache_with_graphs():
    """Was refused (NotImplementedError) while the runner got it wrong: a CascadeCache of the caller's with the runner's
    static step now starts from such a batch, with stock's tokens."""
    from hf_cascade import CascadeCache, CascadeConfig
    from conftest import cache_kw
    stock, cascade = model_pair("llama")
    ids = torch.tensor([[0, 0, 0, 5], [0, 0, 0, 7]])
    mask = (ids != 0).long()
    cache = CascadeCache(cascade.config, CascadeConfig(cuda_graphs="eager"))
    want = _generate(stock, ids, mask, num_beams=3, max_new_tokens=6)
    got = _generate(cascade, ids, mask, num_beams=3, max_new_tokens=6, **cache_kw(cascade, cache))
    assert torch.equal(got, want)


# ---- a padded batch with empty prompts -------------------------------------------------------------------------------
EMPTY_BATCHES = {"all-empty": [[0, 0, 0, 0], [0, 0, 0, 0]], "all-empty-width-one": [[0], [0]],
                 "empty-and-one-token": [[0, 0, 0, 0], [0, 0, 0, 1]], "empty-and-longer": [[0, 0, 0, 0], [0, 1, 1, 1]]}


@pytest.fixture(scope="module")
def pad_embedding_pair():
    """Token 0 (the pad) has an embedding of its own (no pad_token_id in the config): a pad's query, key and value are
    not zero, so what an empty prompt's last pad attends to shows in the tokens (with a zero pad embedding it did not)."""
    return model_pair("llama", pad_token_id=None)


def _empty_batch(name):
    mask = torch.tensor(EMPTY_BATCHES[name])
    return torch.randint(3, 96, mask.shape, generator=torch.Generator().manual_seed(0)).masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("chooser", ["device", "host"])
@pytest.mark.parametrize("setting", sorted(AUTOCAST_SETTINGS))
@pytest.mark.parametrize("batch", sorted(EMPTY_BATCHES))
def test_empty_prompts_on_the_static_step_give_stock_tokens(pad_embedding_pair, batch, setting, chooser, monkeypatch):
    """A batch where some or every prompt is empty (all padding): nothing of it is stored and the first decode step
    feeds its last pad, whose query stock's mask hides every key from (sdpa gives 0). The whole step ran that first
    step without the attention mask, so where no row held a token yet (a fresh step: dense attention over the new K/V)
    the pad attended to itself: other tokens than stock (worked around by decoding an all-empty batch without the
    runner, and refusing it on a caller's CascadeCache; a batch of an empty prompt and one-token prompts was wrong).
    The whole step's device steps begin at the third step (the second stores an empty row's first token: not static),
    not never."""
    from hf_cascade import CascadeCache, CascadeConfig
    from conftest import RunnerSpy, cache_kw, host_loop
    stock, cascade = pad_embedding_pair
    ids, mask = _empty_batch(batch)
    kwargs = {**AUTOCAST_SETTINGS[setting], "max_new_tokens": 6, "pad_token_id": 0,
              **(host_loop() if chooser == "host" else {})}
    want = _generate(stock, ids, mask, **kwargs)
    spy = RunnerSpy(monkeypatch)
    for extra in (dict(path=PATHS["eager-static"]),
                  cache_kw(cascade, CascadeCache(cascade.config, CascadeConfig(cuda_graphs="eager")))):
        got = _generate(cascade, ids, mask, **extra, **kwargs)
        assert torch.equal(got, want), extra
        runner = spy.runners[-1]      # the device takes the steps over once every row holds a token (the third)
        assert runner is not None and runner.device_steps > 0, extra


@pytest.mark.parametrize("setting", sorted(AUTOCAST_SETTINGS))
@pytest.mark.parametrize("batch", ["all-empty", "empty-and-one-token"])
def test_continuing_a_cache_that_began_with_empty_prompts(pad_embedding_pair, batch, setting):
    """A caller's CascadeCache with the static step, filled by a greedy call whose prompts are empty (the whole step),
    continued with new tokens (a beam search, greedy or sampling call): stock's tokens for the whole conversation."""
    from hf_cascade import CascadeCache, CascadeConfig
    from conftest import cache_kw
    stock, cascade = pad_embedding_pair
    ids, mask = _empty_batch(batch)
    cache = CascadeCache(cascade.config, CascadeConfig(cuda_graphs="eager"))
    first_kw = dict(do_sample=False, max_new_tokens=5, pad_token_id=0)
    first = _generate(cascade, ids, mask, **first_kw, **cache_kw(cascade, cache))
    assert torch.equal(first, _generate(stock, ids, mask, **first_kw))
    new = torch.randint(3, 96, (ids.shape[0], 3), generator=torch.Generator().manual_seed(1))
    ids2 = torch.cat([first, new], 1)
    mask2 = torch.cat([mask, mask.new_ones(ids2.shape[0], ids2.shape[1] - mask.shape[1])], 1)
    kwargs = {**AUTOCAST_SETTINGS[setting], "max_new_tokens": 5, "pad_token_id": 0}
    got = _generate(cascade, ids2, mask2, **kwargs, **cache_kw(cascade, cache))
    assert torch.equal(got, _generate(stock, ids2, mask2, **kwargs))     # (stock: the conversation afresh)


# ---- Trainer's mixed-precision evaluation ------------------------------------------------------------------------
def _mixed_precision_predictions(family: str, device: str, tmp_path):
    """Seq2SeqTrainer(predict_with_generate=True, bf16=True) on a float32 model (accelerate runs its forward under
    autocast): (stock's predictions, the cascade's, whether the cascade's forwards ran under autocast, its runners)."""
    import pathlib
    import sys
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from hf_cascade import session
    from conftest import VOCAB
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    import trainer_eval
    if family == "llama":
        stock, cascade = model_pair("llama", dtype=torch.float32, seed=1)
        data = trainer_eval.synthetic_dataset(6, VOCAB, prompt_lens=(4, 15), target_len=5, seed=1)
        trainer_cls, collator = trainer_eval.CausalLMSeq2SeqTrainer, trainer_eval.PromptTargetCollator(0)
    else:
        from test_encoder_decoder import pair
        pytest.importorskip("rouge_score")
        import seq2seq_eval
        stock, cascade = pair("bart", dtype=torch.float32)
        data = seq2seq_eval.make_dataset(None, VOCAB, n=6, max_len=40)
        trainer_cls, collator = Seq2SeqTrainer, seq2seq_eval.Collator(stock.config.pad_token_id)
    seen, runners = [], []
    real = session.DecodeSession.decode_runner

    def spy(self):
        runners.append(real(self))
        return runners[-1]

    predictions = []
    for name, model in (("stock", stock), ("cascade", cascade)):
        model.to(device)
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / name), per_device_eval_batch_size=4,
                                        predict_with_generate=True, generation_num_beams=3, report_to="none",
                                        use_cpu=device == "cpu", bf16=True, dataloader_num_workers=0,
                                        disable_tqdm=True, remove_unused_columns=False)
        trainer = trainer_cls(model=model, args=args, data_collator=collator)
        session.DecodeSession.decode_runner = spy
        # (read inside the forward: accelerate wraps the model's forward in autocast, not its hooks)
        # read inside the forward (accelerate wraps the model's forward in autocast, not its hooks), by lm_head's own
        # forward (a hook there would make the steps eager)
        head = model.get_output_embeddings()
        head.forward = lambda x, forward=head.forward: (seen.append(torch.is_autocast_enabled(device)), forward(x))[1]
        try:
            predictions.append(trainer.predict(data, max_new_tokens=6).predictions)
        finally:
            session.DecodeSession.decode_runner = real
            del head.forward
    return predictions[0], predictions[1], any(seen), runners


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_trainer_bf16_evaluation_gives_stocks_predictions(family, tmp_path):
    want, got, under_autocast, _ = _mixed_precision_predictions(family, "cpu", tmp_path)
    assert under_autocast
    assert want.shape == got.shape and (want == got).all()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "bart"])
def test_gpu_trainer_bf16_evaluation_gives_stocks_predictions_with_captured_steps(family, tmp_path, no_tf32):
    want, got, under_autocast, runners = _mixed_precision_predictions(family, "cuda", tmp_path)
    assert under_autocast
    agree = float((want == got).mean()) if want.shape == got.shape else 0.0
    print(f"{family}: bf16 Trainer predictions agree with stock's on {agree:.1%} of the tokens")
    assert want.shape == got.shape and (want == got).all()
    captured = [r for r in runners if r is not None and (r.captures or r.replays)]
    assert captured, "no decode step was captured"


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["beam", "greedy"])
def test_gpu_autocast_with_captured_steps(setting, monkeypatch, no_tf32):
    """A float32 Llama on the GPU under torch.autocast("cuda", bf16): stock runs (K float32 from rotary, V bf16), the
    cascade stores both in bf16 and replays captured steps; tokens agree with stock's (bf16 rounding: the agreement
    is printed, the beams' scores are within rounding)."""
    from conftest import RunnerSpy
    stock, cascade = model_pair("llama", dtype=torch.float32, seed=1, hidden_size=256, intermediate_size=512,
                                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    stock.cuda(), cascade.cuda()
    ids = torch.randint(3, 90, (2, 600), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    spy = RunnerSpy(monkeypatch)
    kwargs = {**AUTOCAST_SETTINGS[setting], "max_new_tokens": 24}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = _generate(stock, ids, mask, **kwargs)
        got = _generate(cascade, ids, mask, **kwargs)
    runner = spy.runners[-1]
    assert runner is not None and runner.captures >= 1 and runner.replays + runner.device_steps > 10
    agree = float((want == got).float().mean()) if want.shape == got.shape else 0.0
    print(f"autocast bf16 {setting}: {agree:.1%} of the tokens agree with stock's")
    assert agree > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("setting", ["beam", "greedy"])
def test_gpu_hooks_with_captured_steps(hook, setting, monkeypatch, no_tf32):
    """On the GPU (float32): a hook on the model runs once per chosen token, around every step (the whole step's steps
    then run eagerly through ``model.__call__``, not captured), a hook on a layer makes the steps eager too (logged);
    tokens and counts are stock's."""
    from conftest import RunnerSpy
    stock, cascade = model_pair("llama", dtype=torch.float32, seed=2)
    stock.cuda(), cascade.cuda()
    ids, mask = (t.cuda() for t in padded_batch(lengths=(23, 17)))
    spy = RunnerSpy(monkeypatch)
    kwargs = {**AUTOCAST_SETTINGS[setting], "max_new_tokens": 9}
    results = []
    for model in (stock, cascade):
        hooks = _Hooks(model, **HOOKS[hook])
        try:
            results.append((_generate(model, ids, mask, **kwargs), hooks.calls))
        finally:
            hooks.remove()
    (want, want_calls), (got, got_calls) = results
    assert torch.equal(got, want)
    runner = spy.runners[-1]
    assert runner.captures == 0 and runner.device_steps >= 5
    if hook == "layer":
        assert got_calls >= want_calls
    else:
        assert got_calls == want_calls and runner.through_call
