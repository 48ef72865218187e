from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_prints_a_reply():
    r = run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_bad_input_is_a_clear_error():
    r = run("generate", "--prompt", "hi", "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf")
    assert r.returncode == 2 and "/nonexistent/model.gguf" in r.stderr
