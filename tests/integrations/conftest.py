"""The integration tests build the tiny configs of the model tests (`tests/models/tiny_models.py`)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


@pytest.fixture(scope="module")
def restore_veomni_state():
    """VeOmni binds module-level slots and transformers' LOSS_MAPPING: put both back for later tests."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    saved = dict(LOSS_MAPPING)
    yield
    LOSS_MAPPING.clear()
    LOSS_MAPPING.update(saved)
    for name, module in list(sys.modules.items()):
        if name.startswith("veomni.models.transformers.") and ".generated." in name:
            for value in list(vars(module).values()):
                if type(value).__name__ == "OpSlot":
                    value._kernel, value._impl_name = None, None
