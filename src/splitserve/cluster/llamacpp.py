"""llama.cpp's OpenAI server (``llama-cpp-python``) as a peer deployment for the benchmarks.

It runs from a virtualenv of its own (``make install-llamacpp`` builds it from source), on
the same GGUF file the built-in engine loads, with its threads bound to the cores it is
given. It serves one request at a time, as its users get it.
"""

from __future__ import annotations

import os

from splitserve.cluster.vllm_worker import first_executable, repo_root, venv_pythons

VENV_ENV = "SPLITSERVE_LLAMACPP_VENV"
INSTALL_HINT = "run `make install-llamacpp`"
# Its routes: no /health; /v1/models answers once the model is loaded.
HEALTH_PATH = "/v1/models"
# Room for the benchmarks' longest sessions (the bundled model's trained context is 8k).
CONTEXT_TOKENS = 8192


def find_llamacpp_python() -> str:
    """The Python that has ``llama_cpp``: ``$SPLITSERVE_LLAMACPP_VENV/bin/python`` or the
    repository's ``.venv-llamacpp``. Raises ``ValueError`` naming ``make install-llamacpp``."""
    candidates = venv_pythons(os.environ.get(VENV_ENV), str(repo_root() / ".venv-llamacpp"))
    python = first_executable(candidates)
    if python is None:
        raise ValueError(
            f"llama.cpp is not installed (looked for {candidates[-1]}); {INSTALL_HINT}"
        )
    return python


def llamacpp_argv(python: str, gguf: str, host: str, port: int, threads: int) -> list[str]:
    """The server's command line: ``threads`` for decoding and for prompt batches."""
    return [
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--host",
        host,
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        str(CONTEXT_TOKENS),
        # Its default ends a streaming request when the next one arrives; queue them instead.
        "--interrupt_requests",
        "False",
    ]


def eos_logit_bias(gguf: str) -> dict[str, float]:
    """A ``logit_bias`` that keeps ``gguf``'s control tokens (end of sequence, end of turn
    and the other specials, GGUF token type 3) from being sampled: the benchmarks' fixed output
    lengths, which the other servers get from ``ignore_eos``."""
    from splitserve.models import gguf_loader

    field = gguf_loader.open_gguf(gguf).fields["tokenizer.ggml.token_type"]
    types = (int(field.parts[i][0]) for i in field.data)
    return {str(token): -100.0 for token, kind in enumerate(types) if kind == _CONTROL}


_CONTROL = 3  # GGUF's token type of control tokens
