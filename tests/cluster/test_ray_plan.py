"""What a Ray deployment's processes are started with (``cluster.ray_plan``), without a
cluster: TLS flags pointing into the directory each host writes, and under a keys file the
key arrangement for vLLM workers (one key, the routers' alone)."""

from __future__ import annotations

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
