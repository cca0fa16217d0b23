"""The SDK's logger, ``foretell.sdk``, and the ``FORETELL_LOG`` switch.

The SDK only emits records (retries at INFO, each request at DEBUG); where they go is the
application's choice, as with any library. ``FORETELL_LOG=info`` or ``=debug`` is a shortcut for
scripts: it gives the logger a stderr handler at that level when ``foretell.sdk`` is imported.
Records never hold the API key: they carry methods, URLs, statuses and request ids only, and go
through the same redaction as the errors.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

logger = logging.getLogger("foretell.sdk")

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO}


class _EnvHandler(logging.StreamHandler):
    """The handler FORETELL_LOG adds (a class of its own so that it is added only once)."""


def setup_logging(env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    level = LEVELS.get(env.get("FORETELL_LOG", "").strip().lower())
    if level is None:
        return  # unset or unknown: leave logging to the application
    if not any(isinstance(h, _EnvHandler) for h in logger.handlers):
        handler = _EnvHandler()  # stderr
        handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s %(levelname)s] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
