"""Encoder-decoder models on the cascade path: the entry (``encoder_decoder``), what differs per family
(``seq2seq_models``), cross-attention K/V stored once per input (``cross_kv``, ``cross_attention``), the dense
self-attention cache (``dense_cache``) and the encoder output kept unexpanded (``encoder_expansion``)."""
