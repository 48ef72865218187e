"""``splitserve router`` arguments, and a router process started from the command line."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from splitserve.cluster.local import die_with_parent
from splitserve.router.cli import add_router_parser, config_from_args
from splitserve.router.proxy import DECODE_HEADER

from .conftest import HTTP, free_port, wait_until

pytestmark = pytest.mark.timeout(120)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["router", *argv])


def test_arguments_become_a_config(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_API_KEY", "from-env")
    args = parse(
        "--decode",
        "h:1",
        "h:2",
        "--prefill",
        "h:3",
        "--policy",
        "least-loaded",
        "--load-factor",
        "1.5",
        "--load-floor",
        "2",
        "--disaggregate",
    )
    cfg = config_from_args(args)
    assert cfg.decode == ["h:1", "h:2"] and cfg.prefill == ["h:3"]
    assert cfg.policy == "least-loaded" and cfg.load_factor == 1.5 and cfg.disaggregate
    assert cfg.load_floor == 2
    assert cfg.api_key == "from-env" and cfg.admin_key == "from-env"
    assert [(w.url, w.role) for w in cfg.initial_workers()] == [
        ("http://h:1", "decode"),
        ("http://h:2", "decode"),
        ("http://h:3", "prefill"),
    ]


def test_no_workers_is_a_clear_error():
    with pytest.raises(SystemExit, match="at least one --decode or --workers"):
        config_from_args(parse("--prefill", "h:3"))


def test_bad_options_are_rejected():
    with pytest.raises(SystemExit):
        parse("--workers", "h:1", "--policy", "random")
    with pytest.raises(ValueError, match="load_factor must be >= 1"):
        config_from_args(parse("--workers", "h:1", "--load-factor", "0.5"))
    with pytest.raises(ValueError, match="load_floor must be >= 1"):
        config_from_args(parse("--workers", "h:1", "--load-floor", "0"))
    with pytest.raises(ValueError, match="listed twice"):
        config_from_args(parse("--workers", "h:1", "--decode", "http://h:1/")).initial_workers()


def test_router_process_serves_through_a_worker(workers3):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitserve.router.cli",
            "--port",
            str(port),
            "--workers",
            workers3[0].url,
            "--log-level",
            "warning",
        ],
        preexec_fn=die_with_parent,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, "the router exited"
        try:
            return HTTP.get(url + "/health", timeout=1.0).status_code == 200
        except Exception:
            return False

    try:
        wait_until(up, what="the router process")
        r = HTTP.post(url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 200 and r.headers[DECODE_HEADER] == workers3[0].url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
