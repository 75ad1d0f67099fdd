"""The KV cache: the transformers Cache over a paged, copy-on-write block pool (``cache``), its block bookkeeping
(``blocks``), the pools' memory (``memory``), one step's plan (``plan``, ``context``) and the static step's
interface (``static_step``)."""
