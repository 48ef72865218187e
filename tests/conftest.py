"""Shared fixtures. Nothing here may reach a model hub."""

from __future__ import annotations

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# "auto" resolves to float32 in every test and every process the tests start, whatever the
# CPU: the suite's exact comparisons are written for float32, and CI machines differ in their
# bfloat16 flags. The bfloat16 path is tested by name (tests/models/test_bfloat16.py).
os.environ["SPLITSERVE_CPU_BF16"] = "0"
# torch's and numba's OpenMP threads (libgomp) sleep when idle instead of spinning, in this
# process and every process it starts (set before anything loads libgomp; a value already in
# the environment wins). The suite shares its 2 cores with the workers it starts and often
# with other jobs: a spinning thread then holds the core its partner needs, and every parallel
# region waits a scheduler slice for it. The same greedy decode of 32 tokens on a
# SmolLM2-sized model at 2 threads, one other busy process on the machine: 6-47 s spinning,
# 2-3 s sleeping (1.8 s at one thread); tests/entrypoints while another suite ran: 105-143 s
# spinning, 32-38 s sleeping. Numerics are the same either way; only idle threads change.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _model_cache_of_this_run(tmp_path_factory):
    """Converted models (``splitserve.models.gguf_cache``) go to a directory of this test
    run, which the workers the tests start inherit: the first load of the default model
    converts it, every later one (in any process) reads the conversion. The user's own
    cache is neither read nor written. Removed at the end (a conversion is ~0.5 GB)."""
    root = tmp_path_factory.mktemp("model-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPLITSERVE_MODEL_CACHE", str(root))
        yield
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _one_default_model_per_session(_model_cache_of_this_run):
    """The default model loads once in the test process: ``load_model()`` without a path
    (what ``LLM()``, the calibrating engine and ``default_model`` call) returns one shared
    copy per dtype and device. Loading it is ~10 s a time; engines sharing it stay apart,
    since a runner binds the model to its own KV cache on every step (see
    test_runners_sharing_a_model_keep_their_own_cache). Paths are loaded as before."""
    from splitserve.models import loader

    real = loader.load_model
    copies: dict[tuple, object] = {}

    def load_model(path=None, dtype="auto", device="cpu", load_tokenizer=True):
        if path is not None:
            return real(path, dtype, device, load_tokenizer)
        key = (loader.resolve_dtype(dtype, device), str(device), load_tokenizer)
        if key not in copies:
            copies[key] = real(None, dtype, device, load_tokenizer)
        return copies[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "load_model", load_model)
        yield


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
