"""Shared fixtures. Nothing here may reach a model hub."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct Q4_1 GGUF), loaded once per session."""
    from splitserve.models.loader import load_model

    return load_model()


# Shared helpers for process-level tests (``from procs import ...``); the importlib import
# mode does not put the tests directory on sys.path by itself.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
