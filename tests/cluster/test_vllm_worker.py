"""``--engine vllm`` without starting vLLM: the command line, environment, core split, flags
refused, and a missing vLLM as a clear error. tests/cluster/test_vllm_serve.py runs it."""

from __future__ import annotations

import pytest

from splitserve.cli import build_parser, main, serve_topology, serve_worker_args
from splitserve.cluster.vllm_worker import (
    VllmWorkerSpec,
    find_vllm_python,
    parse_cpus,
    vllm_argv,
    vllm_env,
)


def test_argv_carries_the_model_resources_and_limits():
    spec = VllmWorkerSpec("/m", "name", port=8123, kv_cache_gb=0.5, cpus="1", max_num_seqs=8)
    argv = vllm_argv("/py", spec)
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = zip(argv[3:], argv[4:], strict=False)
    flags = {a: b for a, b in pairs if a.startswith("--") and not b.startswith("--")}
    assert "--enable-prompt-tokens-details" in argv  # usage reports vLLM's cached_tokens
    assert flags["--model"] == "/m" and flags["--served-model-name"] == "name"
    assert flags["--port"] == "8123" and flags["--kv-cache-memory-bytes"] == str(1 << 29)
    assert flags["--max-num-seqs"] == "8" and "--max-model-len" not in flags
    assert "--disable-log-stats" not in argv  # it would empty vLLM's /metrics


def test_env_binds_cores_and_passes_the_key(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # would override --kv-cache-memory-bytes
    env = vllm_env(VllmWorkerSpec("/m", "n", cpus="2-3", api_key="k"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3" and env["VLLM_API_KEY"] == "k"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(VllmWorkerSpec("/m", "n"))


def test_cpu_lists_parse_or_fail_clearly():
    assert parse_cpus("0") == [0] and parse_cpus("0-1,4") == [0, 1, 4]
    for bad in ("", "a", "1-x", "-1"):
        with pytest.raises(ValueError, match="--cpus takes core ids"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="--kv-cache-gb must be > 0"):
        VllmWorkerSpec("/m", "n", kv_cache_gb=0)


def test_serve_gives_each_vllm_worker_cores_of_its_own(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    args = build_parser().parse_args(
        ["serve", "--engine", "vllm", "--decode", "3", "--threads-per-worker", "2"]
    )
    topology = serve_topology(args)
    assert [topology.core_args(i) for i in range(3)] == [
        ["--cpus", "0,1"],
        ["--cpus", "2,3"],
        ["--cpus", "0,1"],  # more threads than cores: wraps around
    ]
    worker = build_parser().parse_args(["worker", *serve_worker_args(args), "--cpus", "2,3"])
    assert worker.engine == "vllm" and worker.cpus == "2,3"
    builtin = serve_topology(build_parser().parse_args(["serve", "--decode", "2"]))
    assert builtin.core_args(0) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["worker", "--role", "prefill"], "P/D with vLLM workers is not available yet"),
        (["worker", "--host-kv-gb", "2"], "--host-kv-gb is a builtin-engine option"),
        (["worker", "--scheduling-policy", "shortest-prefill"], "--scheduling-policy"),
        (["serve", "--prefill", "1", "--decode", "1"], "P/D with vLLM workers"),
        (["serve", "--decode", "2", "--kv-peer-fetch"], "--kv-peer-fetch is a builtin-engine"),
    ],
)
def test_builtin_only_flags_are_refused_with_vllm(argv, message, capsys):
    assert main([argv[0], "--engine", "vllm", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_vllm_is_a_one_line_error_naming_make_install_vllm(tmp_path, capsys):
    with pytest.raises(ValueError, match="make install-vllm"):
        find_vllm_python(str(tmp_path / "no-python"))
    assert main(["worker", "--engine", "vllm", "--vllm-python", str(tmp_path / "py")]) == 2
    err = capsys.readouterr().err.strip()
    assert "make install-vllm" in err and len(err.splitlines()) == 1
