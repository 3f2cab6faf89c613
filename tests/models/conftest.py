"""Fixtures for the model tests: tiny configs (see `tiny_models.py`)."""

import pytest
from tiny_models import tiny_qwen3_5_moe_text, tiny_qwen3_moe


@pytest.fixture
def qwen3_5_config():
    return tiny_qwen3_5_moe_text()


@pytest.fixture
def qwen3_moe_config():
    return tiny_qwen3_moe()
