"""BART-family decoders take their positions from a device tensor, so that their decode step can be replayed.

BART, mBART, PLBart, Blenderbot(-small), Pegasus, Marian and M2M100/NLLB decoders compute a step's positions
from the cache length on the host (``cache.get_seq_length()``, then ``arange(seq) + length``); a captured graph
would replay the first step's positions forever. generate's cascade entry gives these decoders, instead,
``decoder_position_ids`` (stock's values: the cache length, pads included; generate advances them on the device
every step) and the forward keyword ``hf_cascade.seq2seq_models.DEVICE_POSITIONS_KWARG``. For a forward that
carries it, the patched decoder hands the positions to its own positional embedding (a context variable, so that
threads generating with one model at once each see their own), whose patched forward looks up the same rows as
stock's from them: ``embedding[positions + offset]`` for the learned and sinusoidal tables, M2M100's
``(cumsum(not pad) + length) * not pad + padding_idx`` with the length from the device. Every other forward (no
keyword: stock's calls, the decoder prompt's prefill, a caller's own decoder_position_ids, which stock's decoders
ignore) runs stock's code unchanged.

Guarded by the transformers versions it was checked on and by what it relies on (the decoder computes its
positions from ``get_seq_length()`` and passes them to ``embed_positions``; the embeddings' forward signatures);
tests/seq2seq/test_seq2seq_graphs.py checks each reliance. A family outside them is not registered, and its decode steps
run without graphs with the reason logged, as before.
"""
from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging

import torch
import transformers

from hf_cascade.compat import SUPPORTED, in_range

logger = logging.getLogger("hf_cascade")

# (modeling module, decoder class, its positional embedding class, the embedding's kind)
FAMILIES = (
    ("bart", "BartDecoder", "BartLearnedPositionalEmbedding", "table"),
    ("mbart", "MBartDecoder", "MBartLearnedPositionalEmbedding", "table"),
    ("plbart", "PLBartDecoder", "PLBartLearnedPositionalEmbedding", "table"),
    ("blenderbot", "BlenderbotDecoder", "BlenderbotLearnedPositionalEmbedding", "table"),
    ("blenderbot_small", "BlenderbotSmallDecoder", "BlenderbotSmallLearnedPositionalEmbedding", "table"),
    ("pegasus", "PegasusDecoder", "PegasusSinusoidalPositionalEmbedding", "table"),
    ("marian", "MarianDecoder", "MarianSinusoidalPositionalEmbedding", "table"),
    ("m2m_100", "M2M100Decoder", "M2M100SinusoidalPositionalEmbedding", "m2m100"),
)
# the embeddings' forward parameters, by kind (the second is named past_key_values_length before 5.2x)
_TABLE_FORWARD = 4             # (self, input_ids or its shape, length, position_ids)
_M2M100_FORWARD = ("self", "input_ids", "inputs_embeds")
_LENGTH_NAMES = ("cache_length", "past_key_values_length")

# (the embedding module of the running decoder, its positions [1 or rows, seq]) while a patched decoder runs a
# forward that carries the keyword; None otherwise
_positions: contextvars.ContextVar = contextvars.ContextVar("hf_cascade_decoder_positions", default=None)
_applied: list = []     # (module name, decoder class) of each family patched
_checked: list = []     # apply() ran


def is_applied() -> bool:
    return bool(_applied)


def applied_families() -> list[str]:
    """The modeling modules whose decoders the patch serves (for tests and diagnostics)."""
    return [name for name, _ in _applied]


def _modeling(name: str):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def unchanged_reason(name: str, decoder: str, embedding: str, kind: str) -> str | None:
    """Why the patch would not fit family ``name`` in the installed transformers (None when it fits)."""
    try:
        modeling = _modeling(name)
    except ImportError as err:
        return f"transformers.models.{name} cannot be imported ({err})"
    decoder_cls, embedding_cls = getattr(modeling, decoder, None), getattr(modeling, embedding, None)
    if decoder_cls is None or embedding_cls is None:
        return f"modeling_{name} has no {decoder if decoder_cls is None else embedding}"
    try:
        source = inspect.getsource(decoder_cls.forward)
    except (OSError, TypeError):
        return f"the source of {decoder}.forward cannot be read"
    if "get_seq_length()" not in source or "self.embed_positions(" not in source:
        return f"{decoder}.forward no longer computes its positions from get_seq_length() through embed_positions"
    params = tuple(inspect.signature(embedding_cls.forward).parameters)
    if kind == "table":
        if not issubclass(embedding_cls, torch.nn.Embedding) or len(params) != _TABLE_FORWARD \
                or params[2] not in _LENGTH_NAMES or params[3] != "position_ids":
            return f"{embedding}.forward takes {params}, not (self, input_ids, length, position_ids) over a table"
    elif params[:3] != _M2M100_FORWARD or params[3] not in _LENGTH_NAMES \
            or not callable(getattr(embedding_cls, "create_position_ids_from_input_ids", None)):
        return f"{embedding}.forward takes {params}, not (self, input_ids, inputs_embeds, length)"
    return None


# ---- the patched forwards ----------------------------------------------------------------------------------------
def _wrap_decoder(original):
    """The decoder's forward: with the keyword, its positional embedding reads ``decoder_position_ids``."""
    from hf_cascade.seq2seq.seq2seq_models import DEVICE_POSITIONS_KWARG

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not kwargs.pop(DEVICE_POSITIONS_KWARG, False):
            return original(self, *args, **kwargs)
        positions = kwargs.pop("decoder_position_ids", None)
        if not isinstance(positions, torch.Tensor) or self.config._attn_implementation != "cascade":
            return original(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            # dynamo cannot trace a context variable: while it traces, the positions ride on the embedding itself (the
            # compiled graph takes them as its input; nothing reads the attribute when the graph runs)
            embedding = self.embed_positions
            embedding.hf_cascade_positions = positions
            try:
                return original(self, *args, **kwargs)
            finally:
                embedding.hf_cascade_positions = None
        token = _positions.set((self.embed_positions, positions))
        try:
            return original(self, *args, **kwargs)
        finally:
            _positions.reset(token)

    forward.__hf_cascade_original__ = original
    return forward


def _override(embedding) -> torch.Tensor | None:
    """The device positions for ``embedding`` in this forward, or None (stock's own)."""
    if torch.compiler.is_compiling():
        return getattr(embedding, "hf_cascade_positions", None)
    entry = _positions.get()
    return entry[1] if entry is not None and entry[0] is embedding else None


def _wrap_table(original):
    """A learned or sinusoidal table (an nn.Embedding): stock looks up ``arange(seq) + length`` (+ BART's offset
    of 2); the same rows from the device positions."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        positions = _override(self)
        if positions is None:
            return original(self, *args, **kwargs)
        return torch.nn.Embedding.forward(self, positions + getattr(self, "offset", 0))

    forward.__hf_cascade_original__ = original
    return forward


def _wrap_m2m100(original):
    """M2M100/NLLB: stock's position of a token is ``(cumsum(not pad) + length) * not pad + padding_idx`` (a pad
    keeps padding_idx); the length from the device positions (their first column)."""

    @functools.wraps(original)
    def forward(self, input_ids=None, inputs_embeds=None, *args, **kwargs):
        positions = _override(self)
        if positions is None:
            return original(self, input_ids, inputs_embeds, *args, **kwargs)
        length = positions[..., :1]
        with torch.no_grad():
            if input_ids is not None:
                rows, width = input_ids.shape
                ids = self.create_position_ids_from_input_ids(input_ids, self.padding_idx, length)
            else:
                rows, width = inputs_embeds.shape[:-1]
                ids = self.create_position_ids_from_inputs_embeds(inputs_embeds, length, self.padding_idx)
            return self.weights.index_select(0, ids.reshape(-1)).view(rows, width, self.weights.shape[-1]).detach()

    forward.__hf_cascade_original__ = original
    return forward


# ---- when a call's positions fit the table ----------------------------------------------------------------------
def _table_reason(decoder, max_length: int) -> str | None:
    """The last position a call feeds is max_length - 1 (at most); stock fails past the table, so graphs are not
    tried there."""
    embedding = decoder.embed_positions
    offset, rows = getattr(embedding, "offset", 0), embedding.weight.shape[0]
    if max_length - 1 + offset >= rows:
        return (f"max_length={max_length} reaches past {type(embedding).__name__}'s {rows - offset} positions")
    return None


def _m2m100_reason(decoder, max_length: int) -> str | None:
    """Stock grows M2M100's sinusoidal table on the host when a position passes its end; a replayed graph could
    not, so graphs are not tried where the call could reach it."""
    embedding = decoder.embed_positions
    rows = embedding.weights.shape[0]
    if embedding.padding_idx + 1 + max_length > rows:
        return (f"max_length={max_length} reaches past {type(embedding).__name__}'s table of {rows} rows, which "
                "stock grows on the host")
    return None


def apply() -> None:
    """Patch every family of :data:`FAMILIES` that fits (once; nothing outside :data:`SUPPORTED`)."""
    if _checked:
        return
    _checked.append(True)
    if not in_range():
        logger.debug("hf_cascade.patches.positions: transformers %s is outside %s; BART-family decode steps run "
                     "without graphs", transformers.__version__, SUPPORTED)
        return
    from hf_cascade.seq2seq.seq2seq_models import register_device_positions

    for name, decoder, embedding, kind in FAMILIES:
        reason = unchanged_reason(name, decoder, embedding, kind)
        if reason is not None:
            logger.debug("hf_cascade.patches.positions: %s not patched: %s", name, reason)
            continue
        modeling = _modeling(name)
        decoder_cls, embedding_cls = getattr(modeling, decoder), getattr(modeling, embedding)
        decoder_cls.forward = _wrap_decoder(decoder_cls.forward)
        embedding_cls.forward = (_wrap_table if kind == "table" else _wrap_m2m100)(embedding_cls.forward)
        register_device_positions(decoder_cls, _table_reason if kind == "table" else _m2m100_reason)
        _applied.append((name, decoder_cls))
