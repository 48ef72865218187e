"""``--engine vllm`` without starting vLLM: the command line, environment, core split, P/D
wiring, flags refused, and a missing vLLM as a clear error. tests/cluster/test_vllm_serve.py
and test_vllm_disagg.py run it."""

from __future__ import annotations

import json

import pytest

from splitserve.cli import build_parser, main, serve_topology, serve_worker_args
from splitserve.cli_vllm import nixl_side
from splitserve.cluster.serve import pool_workers
from splitserve.cluster.vllm_worker import (
    NixlSide,
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
    assert flags["--tool-call-parser"] == "hermes" and "--enable-auto-tool-choice" in argv
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
    with pytest.raises(ValueError, match="--cpus takes core ids"):
        VllmWorkerSpec("/m", "n", cpus="1-x")


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
    argv = ["serve", "--decode", "3", "--threads-per-worker", "2"]
    builtin = serve_topology(build_parser().parse_args(argv))
    assert [builtin.core_args(i)[-1] for i in range(3)] == ["0,1", "2,3", "0,1"]
    assert builtin.core_args(1) == ["--threads", "2", "--cpus", "2,3"]


def test_a_pd_worker_gets_the_nixl_connector_its_side_channel_and_tcp(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    spec = VllmWorkerSpec("/m", "n", cpus="0", nixl=NixlSide("127.0.0.1", 5601))
    argv = vllm_argv("/py", spec)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",  # splitserve's default: never fail a request
    }
    env = vllm_env(spec)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601" and env["UCX_TLS"] == "tcp,self"
    collocated = VllmWorkerSpec("/m", "n", cpus="0")
    assert "--kv-transfer-config" not in vllm_argv("/py", collocated)
    assert not {"VLLM_NIXL_SIDE_CHANNEL_PORT", "UCX_TLS"} & set(vllm_env(collocated))
    with pytest.raises(ValueError, match="--kv-port must be a TCP port"):
        NixlSide("127.0.0.1", 0)


def test_worker_roles_prefill_and_decode_are_pd_members_and_both_is_not():
    def side(*argv):
        return nixl_side(build_parser().parse_args(["worker", "--engine", "vllm", *argv]))

    assert side("--role", "prefill", "--kv-port", "5601") == NixlSide("127.0.0.1", 5601)
    assert side("--role", "decode", "--host", "10.0.0.2", "--kv-port", "5602").host == "10.0.0.2"
    assert side("--role", "decode").port > 0  # a free port when none is given
    assert side("--role", "decode", "--kv-load-failure-policy", "fail").failure_policy == "fail"
    assert side() is None  # --role both: whole requests, no connector


def _serve_workers(*argv):
    args = build_parser().parse_args(["serve", "--engine", "vllm", *argv])
    return pool_workers("127.0.0.1", None, serve_worker_args(args), {}, serve_topology(args))


def test_serve_pd_gives_each_vllm_worker_its_role_cores_and_side_channel():
    workers = _serve_workers("--prefill", "1", "--decode", "1", "--threads-per-worker", "1")
    prefill, decode = (build_parser().parse_args(w.argv[3:]) for w in workers)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert prefill.cpus != decode.cpus
    assert nixl_side(prefill).port != nixl_side(decode).port
    assert not any("--kv-transport" in w.argv for w in workers)  # builtin-only
    for w in _serve_workers("--decode", "2"):  # no prefill workers: collocated, as before
        alone = build_parser().parse_args(w.argv[3:])
        assert alone.role == "both" and nixl_side(alone) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["worker", "--host-kv-gb", "2"], "--host-kv-gb is a builtin-engine option"),
        (["worker", "--scheduling-policy", "shortest-prefill"], "--scheduling-policy"),
        (["worker", "--role", "prefill", "--kv-transport", "shm"], "--kv-transport is a builtin"),
        (["worker", "--role", "decode", "--kv-encrypt"], "--kv-encrypt is a builtin-engine"),
        (["serve", "--prefill", "1", "--decode", "1", "--kv-transport", "shm"], "--kv-transport"),
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


def test_serve_gives_vllm_workers_a_key_only_the_router_holds_under_a_keys_file(tmp_path):
    # vLLM knows no tenants: clients reach it only through the router, which vouches for them.
    from splitserve.cluster.serve import _pools

    args = build_parser().parse_args(["serve", "--engine", "vllm", "--decode", "2"])
    env = {"SPLITSERVE_API_KEYS": str(tmp_path / "keys.json")}
    pools, (router,) = (
        build().workers for build in _pools("127.0.0.1", 0, None, [], env, serve_topology(args))
    )
    keys = {w.env["SPLITSERVE_API_KEY"] for w in pools}
    assert len(keys) == 1 and len(keys.pop()) >= 32
    assert router.env["SPLITSERVE_WORKER_API_KEY"] == pools[0].env["SPLITSERVE_API_KEY"]
    assert "SPLITSERVE_API_KEY" not in router.env  # no client may use the workers' key
    assert router.argv[router.argv.index("--worker-engine") + 1] == "vllm"


def test_a_keys_file_with_a_lone_vllm_worker_is_refused(tmp_path, capsys):
    keys = tmp_path / "keys.json"
    keys.write_text('[{"key": "sk-a", "tenant": "alice"}]')
    assert main(["serve", "--engine", "vllm", "--api-keys", str(keys)]) == 2
    assert "needs the router in front (--decode N)" in capsys.readouterr().err


def test_lora_modules_become_vllms_flags_with_a_rank_that_fits(tmp_path):
    from adapters import write_lora_adapter

    from splitserve.cli_vllm import lora_args
    from splitserve.models.hf_export import hf_model_dir
    from splitserve.models.loader import default_model_path

    model = hf_model_dir(default_model_path())
    small = write_lora_adapter(tmp_path / "small", model, rank=4)
    large = write_lora_adapter(tmp_path / "large", model, rank=12)
    argv = ["worker", "--engine", "vllm", "--lora-modules", f"a={small}", f"b={large}"]
    out = lora_args(build_parser().parse_args(argv))
    assert out == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--max-loras",
        "2",
        "--lora-modules",
        f"a={small}",
        f"b={large}",
    ]
    serve = ["serve", "--engine", "vllm", "--lora-modules", f"a={small}"]
    worker_args = serve_worker_args(build_parser().parse_args(serve))
    assert worker_args[worker_args.index("--lora-modules") + 1] == f"a={small}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["worker", "--lora-modules", "a=/x"], "needs --engine vllm"),
        (["serve", "--lora-modules", "a=/x"], "needs --engine vllm"),
        (["worker", "--engine", "vllm", "--lora-modules", "a"], "wants NAME=PATH"),
        (["worker", "--engine", "vllm", "--lora-modules", "a=/nowhere"], "no PEFT LoRA adapter"),
    ],
)
def test_bad_lora_modules_are_clear_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_vllm_worker_serves_https_with_the_deployments_files():
    spec = VllmWorkerSpec("/m", "n", ssl_certfile="/c.pem", ssl_keyfile="/k.pem", ca="/ca.pem")
    argv = vllm_argv("/py", spec)
    assert argv[argv.index("--ssl-certfile") + 1] == "/c.pem"
    assert argv[argv.index("--ssl-keyfile") + 1] == "/k.pem"
    assert spec.scheme == "https" and VllmWorkerSpec("/m", "n").scheme == "http"
    with pytest.raises(ValueError, match="go together"):
        VllmWorkerSpec("/m", "n", ssl_certfile="/c.pem")
