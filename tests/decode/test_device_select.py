"""hf_cascade.device_select against transformers' own loop, on the CPU: the same logits drive ``generate`` and a
loop of ``step`` calls, and the outputs must be equal token for token and score for score (and stop at the same
step). The model is a fake whose float64 logits are a fixed function of the (masked) input ids, so both loops see
identical logits; it records the generation config and processors transformers used, which the config here is
built from and checked against."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation import logits_process as hf_processors
from transformers.modeling_outputs import CausalLMOutput

from hf_cascade import device_select
from hf_cascade.device_select import SelectionConfig, UnsupportedSelection, finalize, new_state, step
from conftest import tiny_config

EOS, PAD, VOCAB = 3, 0, 48


class ReplayConfig(PretrainedConfig):
    model_type = "device_select_replay"

    def __init__(self, vocab_size=VOCAB, width=16, eos_bias=1.5, seed=0, **kwargs):
        self.vocab_size, self.width, self.eos_bias, self.seed = vocab_size, width, eos_bias, seed
        super().__init__(**kwargs)


class RecordsDecoding:
    """Records the generation config, processors and criteria generate hands its decoding loop in ``self.seen``."""

    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        self.seen.append((generation_config, logits_processor, stopping_criteria))
        return GenerationMixin._beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                            **kwargs)

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        self.seen.append((generation_config, logits_processor, stopping_criteria))
        return GenerationMixin._sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                       **kwargs)


class ReplayLM(RecordsDecoding, PreTrainedModel, GenerationMixin):
    """Logits of the last position = 3 · tanh(Σ 0.6^age · embed[token]) @ head, masked positions left out, plus
    ``eos_bias`` on eos so that hypotheses end early. No cache: generate runs with ``use_cache=False``."""
    config_class = ReplayConfig

    def __init__(self, config):
        super().__init__(config)
        generator = torch.Generator().manual_seed(config.seed)
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))   # gives the model a dtype/device
        self.register_buffer("embed", torch.randn(config.vocab_size, config.width, generator=generator,
                                                  dtype=torch.float64))
        self.register_buffer("head", torch.randn(config.width, config.vocab_size, generator=generator,
                                                 dtype=torch.float64))
        self.seen, self.forwards = [], 0

    def _init_weights(self, module):
        pass

    def forward(self, input_ids, attention_mask=None, **kwargs):
        self.forwards += 1
        age = 0.6 ** torch.arange(input_ids.shape[1] - 1, -1, -1, dtype=torch.float64)
        weights = age.expand(input_ids.shape) if attention_mask is None else age * attention_mask
        hidden = torch.tanh((self.embed[input_ids.clamp(min=0)] * weights[..., None]).sum(1))
        logits = 3.0 * hidden @ self.head
        for eos in _as_list(self.config.eos_token_id):
            logits[:, eos] += self.config.eos_bias
        return CausalLMOutput(logits=logits[:, None, :])


def _as_list(ids):
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def make_model(eos=EOS, eos_bias=1.5, seed=0) -> ReplayLM:
    return ReplayLM(ReplayConfig(eos_token_id=eos, pad_token_id=PAD, eos_bias=eos_bias, seed=seed)).eval()


def prompts(lengths=(6,), seed=0):
    """Left-padded prompts of the given lengths (tokens >= 5, so neither pad nor eos)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.int64)
    mask = torch.zeros((len(lengths), width), dtype=torch.int64)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(5, VOCAB, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def device_loop(model, config: SelectionConfig, ids, mask, step=step, generator=None):
    """generate's loop with the selection of device_select: forward the filled part, step, until done; checks
    that step's (tokens, parents) describe the new sequences."""
    expand = config.num_beams if config.is_beam else config.num_return_sequences
    ids, mask = ids.repeat_interleave(expand, 0), mask.repeat_interleave(expand, 0)
    state = new_state(config, ids, mask, generator=generator)
    length = ids.shape[1]
    while True:
        logits = model(state.sequences[:, :length], attention_mask=mask).logits[:, -1]
        before = state.sequences.clone()
        tokens, parents = step(state, logits)
        # the contract a cache relies on: each row continues its parent's sequence with its token
        assert torch.equal(state.sequences[:, :length], before[parents, :length])
        assert torch.equal(state.sequences[:, length], tokens)
        if bool(state.done):
            break
        length += 1
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return state


def compare(model, ids, mask, seed=0, **generate_kwargs):
    """Run transformers' generate and the device loop on the same logits; assert equal outputs and stop step."""
    torch.manual_seed(seed)
    model.forwards = 0
    reference = model.generate(ids, attention_mask=mask, use_cache=False, return_dict_in_generate=True,
                               output_scores=True, **generate_kwargs)
    forwards = model.forwards
    generation_config, processors, criteria = model.seen[-1]
    config = SelectionConfig.from_generation_config(generation_config, ids.shape[0], ids.shape[1])
    expand = config.num_beams if config.is_beam else config.num_return_sequences
    config.check_against(processors, criteria, mask.repeat_interleave(expand, 0))
    torch.manual_seed(seed)
    model.forwards = 0
    state = device_loop(model, config, ids, mask)
    ours = finalize(state)
    assert model.forwards == forwards                       # stopped at the same step
    assert ours.sequences.shape == reference.sequences.shape
    assert torch.equal(ours.sequences, reference.sequences)
    if config.is_beam:
        assert torch.equal(ours.sequences_scores, reference.sequences_scores)
    return reference, state


def ended_early(reference, ids, eos=EOS) -> bool:
    return bool((reference.sequences[:, ids.shape[1]:] == eos).any())


# --- greedy and sampling -----------------------------------------------------------------------------------

def test_greedy_without_eos_runs_to_max_length():
    ids, mask = prompts((5, 7, 3))
    reference, _ = compare(make_model(eos=None), ids, mask, max_new_tokens=9)
    assert reference.sequences.shape[1] == ids.shape[1] + 9


def test_greedy_with_eos_pads_finished_rows_and_stops_when_all_finish():
    ids, mask = prompts((6, 2, 4, 6), seed=1)
    reference, _ = compare(make_model(eos_bias=2.5), ids, mask, max_new_tokens=12)
    assert ended_early(reference, ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_equals_transformers_with_the_same_seed(seed):
    # transformers draws torch.multinomial(softmax(scores), 1) from the global generator; so does step
    ids, mask = prompts((6, 3), seed=seed)
    reference, _ = compare(make_model(eos_bias=1.0), ids, mask, seed=seed, do_sample=True, max_new_tokens=10,
                           num_return_sequences=3)
    assert reference.sequences.shape[0] == 6


def test_sampling_from_a_generator_of_its_own():
    # a call may draw from its own generator (a graph needs one registered with it); seeded alike, it draws alike
    model, (ids, mask) = make_model(eos_bias=1.0), prompts((6, 3), seed=2)
    reference, _ = compare(model, ids, mask, seed=7, do_sample=True, max_new_tokens=10, num_return_sequences=2)
    config = SelectionConfig.from_generation_config(model.seen[-1][0], ids.shape[0], ids.shape[1])
    torch.manual_seed(123)      # the global generator is not the one drawn from
    state = device_loop(model, config, ids, mask, generator=torch.Generator().manual_seed(7))
    assert torch.equal(finalize(state).sequences, reference.sequences)


@pytest.mark.parametrize("warpers", [
    dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=0, top_p=0.9),
    dict(temperature=1.3, top_k=7, top_p=0.85, min_p=0.05),
])
def test_sampling_warpers(warpers):
    ids, mask = prompts((5, 6), seed=3)
    compare(make_model(eos_bias=1.0), ids, mask, seed=4, do_sample=True, max_new_tokens=8,
            num_return_sequences=2, **warpers)


@pytest.mark.parametrize("processors", [
    dict(repetition_penalty=1.4), dict(repetition_penalty=0.8), dict(no_repeat_ngram_size=1),
    dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=3), dict(min_new_tokens=5), dict(min_length=9),
    dict(repetition_penalty=1.2, no_repeat_ngram_size=2, min_new_tokens=3),
])
def test_greedy_processors(processors):
    ids, mask = prompts((6, 3, 5), seed=5)
    compare(make_model(eos_bias=2.5), ids, mask, max_new_tokens=10, **processors)


# --- beam search -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -0.7, 2.3])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_beam_search_eos_length_penalty_and_early_stopping(length_penalty, early_stopping):
    ids, mask = prompts((6, 3, 5), seed=6)
    reference, _ = compare(make_model(eos_bias=1.5), ids, mask, num_beams=4, max_new_tokens=10,
                           length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=2)
    if length_penalty <= 1.0:       # a strong length penalty prefers the long hypotheses that did not end
        assert ended_early(reference, ids)


@pytest.mark.parametrize("num_return_sequences", [1, 3, 4])
def test_beam_search_num_return_sequences(num_return_sequences):
    ids, mask = prompts((4, 7), seed=7)
    reference, _ = compare(make_model(eos_bias=1.0), ids, mask, num_beams=4, max_new_tokens=9,
                           num_return_sequences=num_return_sequences)
    assert reference.sequences.shape[0] == 2 * num_return_sequences


def test_beam_search_without_eos_fills_nothing_and_runs_to_max_length():
    ids, mask = prompts((5, 5), seed=8)
    reference, _ = compare(make_model(eos=None), ids, mask, num_beams=3, max_new_tokens=7, num_return_sequences=3)
    assert reference.sequences.shape[1] == ids.shape[1] + 7


def test_beam_search_several_eos_tokens_keep_more_candidates():
    ids, mask = prompts((5, 4), seed=9)
    reference, state = compare(make_model(eos=[3, 5], eos_bias=1.2), ids, mask, num_beams=3, max_new_tokens=9)
    assert state.config.candidates == 9


def test_beam_search_pad_token_zero_fills_with_eos_after_an_early_end():
    ids, mask = prompts((6, 6, 6), seed=0)
    reference, _ = compare(make_model(eos_bias=2.0), ids, mask, num_beams=3, max_new_tokens=10,
                           num_return_sequences=3, early_stopping=True)
    generated = reference.sequences[:, ids.shape[1]:]
    assert (generated[:, -2:] == EOS).all(dim=1).any()      # a shorter hypothesis: its eos, then eos as fill


def test_beam_sampling_sorts_the_sampled_candidates_as_transformers_does():
    ids, mask = prompts((5, 3), seed=11)
    for seed in range(3):
        compare(make_model(eos_bias=1.0), ids, mask, seed=seed, do_sample=True, num_beams=3, max_new_tokens=8,
                top_k=10, temperature=0.9)


def test_beam_sampling_with_eos_ranks_the_sampled_candidates_by_score():
    # the sampled candidates' order decides which eos hits rank within the first num_beams
    ids, mask = prompts((6,), seed=0)
    compare(make_model(eos_bias=1.0, seed=0), ids, mask, seed=0, do_sample=True, num_beams=2, top_k=8,
            max_new_tokens=12)


@pytest.mark.parametrize("early_stopping", ["never", False])
def test_beam_search_never_bounds_by_max_length_once_the_store_is_full(early_stopping):
    # with a full store of finished hypotheses, "never" (length_penalty > 0) keeps searching where False stops
    ids, mask = prompts((5, 3), seed=0)
    compare(make_model(eos_bias=2.0, seed=0), ids, mask, num_beams=2, early_stopping=early_stopping,
            length_penalty=1.5, max_new_tokens=14)


def test_beam_search_early_stopping_true_ends_once_every_slot_is_finished():
    ids, mask = prompts((5, 3), seed=4)
    compare(make_model(eos_bias=2.0, seed=4), ids, mask, seed=4, num_beams=3, early_stopping=True,
            length_penalty=-1.0, max_new_tokens=14)


@pytest.mark.parametrize("processors", [
    dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=1),
    dict(min_new_tokens=6), dict(min_length=10),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=2, length_penalty=1.7),
])
def test_beam_search_processors(processors):
    ids, mask = prompts((6, 2, 4), seed=12)
    compare(make_model(eos_bias=2.5), ids, mask, num_beams=4, max_new_tokens=10, num_return_sequences=2,
            **processors)


# --- each processor on its own, against transformers' object -----------------------------------------------

def _state_for(sequences, cur_len, prompt_length, mask=None, **config):
    rows = sequences.shape[0]
    selection = SelectionConfig(batch_size=rows, prompt_length=prompt_length, max_length=sequences.shape[1],
                                eos_token_ids=(EOS, 7), **config)
    state = new_state(selection, sequences[:, :prompt_length], mask)
    state.sequences[:, :sequences.shape[1]].copy_(sequences)     # (the state's buffer is bucketed: wider)
    state.cur_len.fill_(cur_len)
    return state


@pytest.mark.parametrize("cur_len", range(4, 13))
def test_each_processor_equals_transformers_at_every_length(cur_len):
    generator = torch.Generator().manual_seed(cur_len)
    rows, width, prompt_length = 5, 12, 4
    sequences = torch.randint(0, 6, (rows, width), generator=generator)   # few distinct ids: n-grams repeat
    sequences[:, cur_len:] = -1
    mask = torch.ones(rows, prompt_length, dtype=torch.int64)
    mask[1, :2] = 0                                                        # a left-padded row
    scores = torch.randn(rows, VOCAB, generator=generator) * 3
    input_ids = sequences[:, :cur_len]
    eos = torch.tensor([EOS, 7])
    cases = [
        # transformers 5.24 skips each row's left padding (a tensor prompt_ignore_length); 5.17 penalizes it too
        (dict(repetition_penalty=1.7), hf_processors.RepetitionPenaltyLogitsProcessor(
            1.7, prompt_ignore_length=(mask != 0).int().argmax(dim=1)) if device_select._TRANSFORMERS_5_24
         else hf_processors.RepetitionPenaltyLogitsProcessor(1.7)),
        (dict(no_repeat_ngram_size=1), hf_processors.NoRepeatNGramLogitsProcessor(1)),
        (dict(no_repeat_ngram_size=2), hf_processors.NoRepeatNGramLogitsProcessor(2)),
        (dict(no_repeat_ngram_size=4), hf_processors.NoRepeatNGramLogitsProcessor(4)),
        (dict(min_length=6), hf_processors.MinLengthLogitsProcessor(6, eos)),
        (dict(min_new_tokens=3), hf_processors.MinNewTokensLengthLogitsProcessor(prompt_length, 3, eos)),
        (dict(do_sample=True, temperature=0.6), hf_processors.TemperatureLogitsWarper(0.6)),
        (dict(do_sample=True, top_k=4), hf_processors.TopKLogitsWarper(4)),
        (dict(do_sample=True, top_p=0.7), hf_processors.TopPLogitsWarper(0.7)),
        (dict(do_sample=True, min_p=0.2), hf_processors.MinPLogitsWarper(0.2)),
    ]
    for config, processor in cases:
        state = _state_for(sequences, cur_len, prompt_length, mask, **config)
        expected = processor(input_ids, scores.clone())
        assert torch.equal(device_select.process_logits(state, scores.clone()), expected), config


# --- properties of the step itself ---------------------------------------------------------------------------

@pytest.fixture
def no_host_reads(monkeypatch):
    """Make every Python-level read of a tensor's value raise (what would sync a GPU or break a graph capture)."""
    def refuse(*args, **kwargs):
        raise AssertionError("host read of a tensor inside step")
    patches = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "__index__")

    def guarded(function):
        def run(*args, **kwargs):
            originals = {name: getattr(torch.Tensor, name) for name in patches}
            for name in patches:
                monkeypatch.setattr(torch.Tensor, name, refuse)
            try:
                return function(*args, **kwargs)
            finally:
                for name, original in originals.items():
                    monkeypatch.setattr(torch.Tensor, name, original)
        return run
    return guarded


@pytest.mark.parametrize("generate_kwargs", [
    dict(num_beams=4, num_return_sequences=2, length_penalty=1.3, repetition_penalty=1.2, no_repeat_ngram_size=2,
         min_new_tokens=2),
    dict(num_beams=3, do_sample=True, top_k=6, early_stopping=True),
    dict(do_sample=True, temperature=0.8, top_k=9, top_p=0.9, min_p=0.05, num_return_sequences=2,
         repetition_penalty=1.1, no_repeat_ngram_size=3, min_length=8),
    # the seq2seq checkpoints' processors (forced BOS/EOS, suppressed tokens, single-token bad words)
    dict(num_beams=3, forced_bos_token_id=4, forced_eos_token_id=EOS, suppress_tokens=[5, 6],
         begin_suppress_tokens=[7], bad_words_ids=[[8], [EOS]], no_repeat_ngram_size=2, min_length=6),
    dict(),
])
def test_step_reads_nothing_on_the_host_and_keeps_its_buffers(no_host_reads, generate_kwargs):
    model = make_model(eos_bias=1.5)
    ids, mask = prompts((5, 3), seed=13)
    reference, _ = compare(model, ids, mask, seed=1, max_new_tokens=8, **generate_kwargs)
    generation_config = model.seen[-1][0]
    config = SelectionConfig.from_generation_config(generation_config, ids.shape[0], ids.shape[1])
    buffers = {}

    def checked_step(state, logits):
        if not buffers:
            buffers.update({name: (t.data_ptr(), t.shape) for name, t in state.tensors().items()})
        result = no_host_reads(step)(state, logits)
        assert {name: (t.data_ptr(), t.shape) for name, t in state.tensors().items()} == buffers
        return result
    torch.manual_seed(1)
    state = device_loop(model, config, ids, mask, step=checked_step)
    assert torch.equal(finalize(state).sequences, reference.sequences)


@pytest.mark.parametrize("generate_kwargs", [
    dict(num_beams=4, num_return_sequences=2, early_stopping="never", length_penalty=2.0),
    dict(do_sample=True, num_return_sequences=2), dict(),
])
def test_steps_after_done_change_nothing(generate_kwargs):
    model = make_model(eos_bias=2.0)
    ids, mask = prompts((5, 3), seed=14)
    reference, state = compare(model, ids, mask, seed=2, max_new_tokens=10, **generate_kwargs)
    before = {name: t.clone() for name, t in state.tensors().items()}
    logits = torch.randn(state.config.rows, VOCAB, dtype=torch.float64)
    for _ in range(3):
        tokens, parents = step(state, logits)
        assert torch.equal(parents, torch.arange(state.config.rows))
    for name, tensor in state.tensors().items():
        assert torch.equal(tensor, before[name]), name
    assert torch.equal(finalize(state).sequences, reference.sequences)


@pytest.mark.parametrize("setting", [dict(bad_words_ids=[[9, 10]]), dict(typical_p=0.5, do_sample=True),
                                     dict(sequence_bias={(4,): 1.0}),
                                     dict(exponential_decay_length_penalty=(2, 1.5), eos_token_id=3)])
def test_settings_without_a_device_variant_are_refused_by_name(setting):
    model = make_model()
    ids, mask = prompts((4,))
    model.generate(ids, attention_mask=mask, use_cache=False, max_new_tokens=2, **setting)
    with pytest.raises(UnsupportedSelection, match=next(iter(setting))):
        SelectionConfig.from_generation_config(model.seen[-1][0], 1, ids.shape[1])


class OwnTopK(hf_processors.TopKLogitsWarper):
    pass


class OwnStop:
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("passed, refused", [
    (dict(logits_processor=[hf_processors.TopKLogitsWarper(5)]), "TopKLogitsWarper"),   # replaces top_k=50
    (dict(logits_processor=[OwnTopK(50)]), "OwnTopK"),
    (dict(logits_processor=[hf_processors.TypicalLogitsWarper(0.5)]), "TypicalLogitsWarper"),
    (dict(stopping_criteria=[OwnStop()]), "OwnStop"),
])
def test_a_users_own_processor_or_criterion_is_refused(passed, refused):
    model = make_model()
    ids, mask = prompts((4,))
    model.generate(ids, attention_mask=mask, use_cache=False, max_new_tokens=2, do_sample=True, **passed)
    generation_config, processors, criteria = model.seen[-1]
    config = SelectionConfig.from_generation_config(generation_config, 1, ids.shape[1])
    with pytest.raises(UnsupportedSelection, match=refused):
        config.check_against(processors, criteria)


# --- a real architecture ------------------------------------------------------------------------------------

def recording_llama():
    """A tiny random Llama in float64 that records, like ReplayLM, what generate hands its loop."""
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB, eos_token_id=EOS),
                                             attn_implementation="sdpa", dtype=torch.float64).eval()
    stock = type(model)

    class Recording(RecordsDecoding, stock):
        def forward(self, *args, **kwargs):
            self.forwards += 1
            return super().forward(*args, **kwargs)

    model.__class__ = Recording
    model.seen, model.forwards = [], 0
    return model


@pytest.mark.parametrize("generate_kwargs", [
    dict(), dict(num_beams=3, num_return_sequences=2, length_penalty=0.8, no_repeat_ngram_size=2),
    dict(do_sample=True, top_p=0.9, num_return_sequences=2, repetition_penalty=1.3),
])
def test_a_tiny_llama_in_float64(generate_kwargs):
    ids, mask = prompts((6, 4), seed=15)
    compare(recording_llama(), ids, mask, seed=3, max_new_tokens=8, **generate_kwargs)


@pytest.mark.parametrize("generate_kwargs", [
    dict(num_beams=3, num_return_sequences=2, repetition_penalty=1.2, no_repeat_ngram_size=2, min_new_tokens=2,
         length_penalty=1.3),
    dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, num_return_sequences=2),
])
def test_step_traces_as_one_graph_for_the_whole_call(generate_kwargs):
    # fullgraph=True fails on any host read or Python branch on a tensor; one graph means no retrace per step
    model = make_model()
    ids, mask = prompts((5, 3), seed=16)
    reference, _ = compare(model, ids, mask, seed=5, max_new_tokens=6, **generate_kwargs)
    config = SelectionConfig.from_generation_config(model.seen[-1][0], ids.shape[0], ids.shape[1])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(5)
    state = device_loop(model, config, ids, mask, step=torch.compile(step, backend="eager", fullgraph=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(finalize(state).sequences, reference.sequences)
