"""verl plugin entry point (`verl.plugins` group): registers verl_moe's engines with verl.

Importing this module must never break verl: failures are logged at WARNING and swallowed.
"""

import logging

logger = logging.getLogger(__name__)


def register_all() -> None:
    """Register our engines with verl's EngineRegistry (filled by the engine modules)."""


try:
    register_all()
except Exception as exc:  # verl's loader would hide this at debug level
    logger.warning("verl_moe: engine registration failed: %s", exc)
