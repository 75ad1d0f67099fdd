"""Load a Hub checkpoint in the examples without sitting on retries where the Hub cannot be reached.

Without network, ``from_pretrained("org/name")`` waits through huggingface_hub's retries (about 45 s per
file on a machine whose DNS fails at once, longer where connections hang) before it raises, unless
``HF_HUB_OFFLINE=1`` is set. :func:`from_pretrained_kwargs` asks the Hub once, with a short timeout, and
says at once what to do instead::

    kw = hub_check.from_pretrained_kwargs(model_id)     # raises OSError at once if it cannot be loaded
    model = AutoModelForCausalLM.from_pretrained(model_id, **kw)
"""
from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request


def _endpoint() -> str:
    from huggingface_hub import constants
    return constants.ENDPOINT


def _offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=None)
def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hub cannot be reached from here (one HEAD request, proxies from the environment honoured), or
    None where it answers (any HTTP status counts as an answer). Asked once per process."""
    try:
        urllib.request.urlopen(urllib.request.Request(_endpoint(), method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as err:       # URLError (no DNS, refused), timeout, bad endpoint
        return str(getattr(err, "reason", err))
    return None


def _cached(model_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache
    return isinstance(try_to_load_from_cache(model_id, "config.json"), str)


def from_pretrained_kwargs(model_id: str, timeout: float = 3.0) -> dict:
    """Extra ``from_pretrained`` keywords that load ``model_id`` without waiting on retries: ``{}`` for a local
    folder, with ``HF_HUB_OFFLINE=1`` (transformers then reads the cache or fails at once) or where the Hub
    answers; ``{"local_files_only": True}`` where the Hub does not answer but the files are cached. Raises
    OSError at once, naming the fix, where neither."""
    if os.path.isdir(os.path.expanduser(model_id)) or _offline():
        return {}
    reason = hub_unreachable(timeout)
    if reason is None:
        return {}
    if _cached(model_id):
        return {"local_files_only": True}
    raise OSError(f"not cached and the Hub does not answer ({reason}); HF_HUB_OFFLINE=1 skips this check")
