"""verl_moe.engines

Its modules log at `VERL_LOGGING_LEVEL` (verl's switch; INFO when unset): the engines' per-batch timing and the
rollout's summaries, which verl's root handler prints where the process has one.
"""

import logging
import os

logging.getLogger(__name__).setLevel(os.environ.get("VERL_LOGGING_LEVEL", "INFO").upper())
