from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def run_together(*argvs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Like ``run`` for each argv, the processes side by side (their model loads overlap)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in argvs
    ]
    done = []
    for args, proc in zip(argvs, procs, strict=True):
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            proc.kill()  # a no-op once it exited
        done.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return done


def test_generate_prints_a_reply_and_split_gemv_gives_the_same_one():
    # Greedy (the default temperature) on two threads, with and without --split-gemv.
    args = ("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    plain, split = run_together(
        (*args, "--threads", "2"), (*args, "--threads", "2", "--split-gemv")
    )
    assert plain.returncode == split.returncode == 0, plain.stderr + split.stderr
    assert "Paris" in plain.stdout
    assert split.stdout == plain.stdout


def test_generate_bad_input_is_a_clear_error():
    r = run("generate", "--prompt", "hi", "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf")
    assert r.returncode == 2 and "/nonexistent/model.gguf" in r.stderr


def test_keygen_writes_a_private_key_once(tmp_path):
    key = tmp_path / "kv.key"
    r = run("keygen", str(key))
    assert r.returncode == 0, r.stderr
    assert key.stat().st_size == 32 and key.stat().st_mode & 0o777 == 0o600
    r = run("keygen", str(key))
    assert r.returncode == 2 and "refusing to overwrite" in r.stderr
    r = run("keygen", str(tmp_path / "missing-dir" / "kv.key"))
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr


def test_worker_tier_flags_fail_clearly_before_loading(tmp_path):
    disk = ["--disk-kv-dir", str(tmp_path / "kv")]
    r = run("worker", *disk, "--kv-encryption-key-file", str(tmp_path / "none"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = run("worker", "--kv-encryption-key-file", str(tmp_path / "none"))
    assert r.returncode == 2 and "needs a disk tier" in r.stderr
    r = run("serve", "--host-kv-gb", "-1")
    assert r.returncode == 2 and "host_kv_gb" in r.stderr
    r = run("worker", *disk, "--kv-retention-quota", "2")
    assert r.returncode == 2 and "retention_quota" in r.stderr


def test_serve_load_factor_below_one_is_a_clear_error():
    r = run("serve", "--decode", "2", "--load-factor", "0.5")
    assert r.returncode == 2 and "--load-factor must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr
    r = run("serve", "--decode", "2", "--load-floor", "0")
    assert r.returncode == 2 and "--load-floor must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_worker_on_cores_it_cannot_have_is_a_clear_error():
    r = run("worker", "--cpus", "4096")
    assert r.returncode == 2 and "core(s) 4096 are not available here" in r.stderr
    assert "Traceback" not in r.stderr
    r = run("worker", "--cpus", "0-x")
    assert r.returncode == 2 and "--cpus takes core ids" in r.stderr


def test_bad_engine_options_are_clear_cli_errors():
    r = run("serve", "--decode", "2", "--max-num-seqs", "0")
    assert r.returncode == 2 and "max_num_seqs must be an integer >= 1" in r.stderr
    r = run("serve", "--decode", "2", "--scheduling-policy", "lifo")
    assert r.returncode == 2 and "invalid choice: 'lifo'" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_passes_its_engine_flags_to_every_worker():
    from splitserve.cli import build_parser, serve_worker_args

    argv = ["serve", "--decode", "2", "--scheduling-policy", "shortest-prefill"]
    argv += ["--max-num-batched-tokens", "256", "--max-num-seqs", "8"]
    worker_args = serve_worker_args(build_parser().parse_args(argv))
    worker = build_parser().parse_args(["worker", *worker_args])
    assert worker.scheduling_policy == "shortest-prefill"
    assert (worker.max_num_batched_tokens, worker.max_num_seqs) == (256, 8)


def test_serve_passes_its_router_flags_to_the_router():
    from splitserve.cli import build_parser, serve_topology

    argv = ["serve", "--decode", "2", "--load-factor", "2", "--load-floor", "3"]
    router_args = list(serve_topology(build_parser().parse_args(argv)).router_args)
    assert router_args[router_args.index("--load-factor") + 1] == "2.0"
    assert router_args[router_args.index("--load-floor") + 1] == "3"
    router = build_parser().parse_args(["router", "--decode", "http://127.0.0.1:1", *router_args])
    assert router.load_factor == 2.0 and router.load_floor == 3 and router.policy == "session"


def test_kv_peer_flags_fail_clearly_before_loading(monkeypatch, capsys):
    from splitserve.cli import main

    monkeypatch.delenv("SPLITSERVE_KV_SECRET", raising=False)
    assert main(["worker", "--kv-peer"]) == 2
    assert "--kv-peer needs the cluster secret" in capsys.readouterr().err
    monkeypatch.setenv("SPLITSERVE_KV_SECRET", "s")
    assert main(["worker", "--kv-peer", "--role", "prefill"]) == 2
    assert "role both or decode" in capsys.readouterr().err
    assert main(["worker", "--kv-peer", "--kv-peer-timeout", "0"]) == 2
    assert "--kv-peer-timeout must be > 0" in capsys.readouterr().err
    assert main(["serve", "--kv-peer-fetch"]) == 2
    assert "--kv-peer-fetch needs decode workers" in capsys.readouterr().err
    assert main(["serve", "--decode", "2", "--kv-peer-fetch", "--kv-peer-timeout", "-1"]) == 2
    assert "--kv-peer-timeout must be > 0" in capsys.readouterr().err


def test_serve_kv_peer_fetch_reaches_the_router_and_the_decode_workers():
    from splitserve.cli import build_parser, serve_topology

    argv = ["serve", "--prefill", "1", "--decode", "2", "--kv-peer-fetch"]
    argv += ["--kv-peer-timeout", "0.25"]
    topology = serve_topology(build_parser().parse_args(argv))
    router = build_parser().parse_args(["router", "--decode", "http://h:1", *topology.router_args])
    assert router.kv_peer_fetch
    decode = build_parser().parse_args(["worker", *topology.role_args("decode")])
    assert decode.kv_peer and decode.kv_peer_timeout == 0.25
    assert "--kv-peer" not in topology.role_args("prefill")
    plain = serve_topology(build_parser().parse_args(["serve", "--decode", "2"]))
    assert "--kv-peer-fetch" not in plain.router_args and plain.role_args("decode") == []
