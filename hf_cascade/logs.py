"""The package's logger (``"hf_cascade"``) and its one log-once rule: a line keyed by what it is about and its level
is logged once per process (a line first logged at INFO still shows once at WARNING). The kernels keep a rule of
their own (``hf_cascade.kernels`` imports nothing of the rest of the package)."""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger("hf_cascade")
_logged: set = set()
_lock = threading.Lock()        # generate may run in several threads


def log_once(key, level: int, message: str, *args) -> None:
    """``logger.log(level, message, *args)`` the first time ``(key, level)`` is seen in this process."""
    with _lock:
        if (key, level) in _logged:
            return
        _logged.add((key, level))
    logger.log(level, message, *args)
