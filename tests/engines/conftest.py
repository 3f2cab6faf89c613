"""Engine tests run verl on the cpu platform (set before anything imports verl)."""

import os

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
