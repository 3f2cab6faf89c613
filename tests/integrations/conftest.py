"""The integration tests build the tiny configs of the model tests (`tests/models/tiny_models.py`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
