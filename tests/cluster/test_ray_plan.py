"""What a Ray deployment's processes are started with (``cluster.ray_plan``), without a
cluster: TLS flags pointing into the directory each host writes, and under a keys file the
key arrangement for vLLM workers (one key, the routers' alone); flags refused before any
cluster is reached."""

from __future__ import annotations

import pytest

from splitserve.cli import main
from splitserve.cluster.ray_plan import ROUTER, RayPlan, Slot, slot_command
from splitserve.cluster.serve import Topology

ENV = {"SPLITSERVE_KV_SECRET": "s", "SPLITSERVE_API_KEYS": "/keys.json"}


def _plan(engine: str, tls: bool = False, env: dict | None = None) -> RayPlan:
    return RayPlan(topology=Topology(decode=1, engine=engine), env=dict(env or ENV), tls=tls)


def test_with_tls_every_process_serves_and_verifies_with_its_hosts_files():
    plan = _plan("builtin", tls=True)
    for slot in (Slot("decode-0", "decode"), Slot(f"{ROUTER}-0", ROUTER)):
        argv, _ = slot_command(plan, slot, {"https://10.0.0.5:8101": "decode"}, {})
        for flag, name in (
            ("--ssl-certfile", "server.pem"),
            ("--ssl-keyfile", "server.key"),
            ("--worker-ca", "ca.pem"),
        ):
            assert argv[argv.index(flag) + 1] == f"{{files}}/{name}"
    argv, _ = slot_command(_plan("builtin"), Slot("decode-0", "decode"), {}, {})
    assert "--ssl-certfile" not in argv


def test_a_started_slot_names_its_scheme():
    slot = Slot("decode-0", "decode", info={"ip": "10.0.0.5", "ports": {"port": 8101}})
    assert slot.url == "http://10.0.0.5:8101"
    slot.info["tls"] = True
    assert slot.url == "https://10.0.0.5:8101"


def test_vllm_workers_get_the_routers_key_and_not_the_keys_file():
    plan = _plan("vllm", env={**ENV, "SPLITSERVE_API_KEY": "internal"})
    _, worker = slot_command(plan, Slot("decode-0", "decode"), {}, {})
    assert worker["SPLITSERVE_API_KEY"] == "internal" and "SPLITSERVE_API_KEYS" not in worker
    _, router = slot_command(plan, Slot(f"{ROUTER}-0", ROUTER), {}, {})
    assert router["SPLITSERVE_API_KEYS"] == "/keys.json"
    assert router["SPLITSERVE_WORKER_API_KEY"] == "internal"
    assert "SPLITSERVE_API_KEY" not in router  # clients authenticate by the keys file alone
    # builtin workers read the keys file themselves
    _, builtin = slot_command(_plan("builtin"), Slot("decode-0", "decode"), {}, {})
    assert builtin["SPLITSERVE_API_KEYS"] == "/keys.json"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--autoscale", "--decode", "2", "--autoscale-patience", "0"],
         "--autoscale-patience must be >= 1, got 0"),
        (["serve", "--autoscale", "--decode", "2", "--autoscale-interval", "0"],
         "--autoscale-interval must be > 0"),
        (["serve", "--autoscale", "--decode", "1"], "--autoscale splits the workers"),
        (["cluster", "status", "--watch", "0"], "--watch must be > 0 seconds, got 0.0"),
    ],
)  # fmt: skip
def test_bad_autoscale_and_watch_flags_are_refused_before_joining(argv, message, capsys):
    assert main([*argv, "--ray", "127.0.0.1:1"]) == 2  # no cluster there: never reached
    assert message in capsys.readouterr().err
