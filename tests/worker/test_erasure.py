"""KV erasure on real workers with a disk tier, and through the router over two of them.

Every completed block is written through to disk, so after a session's turns its blocks lie
in the disk directory. Erasing the session must leave no file naming one of its blocks and
no file holding a byte window of its KV, keep the blocks another session shares, and a
return of the session recomputes what was erased with the same greedy tokens.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest
from procs import free_port, start_worker, stop_group, wait_healthy

from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore.disk import PREFIX_BYTES
from splitserve.router.config import RouterConfig
from tests.router.conftest import RouterServer

BS = 16
OUT = 8
ARGS = ["--kv-cache-gb", "0.015", "--host-kv-gb", "0.05", "--disk-kv-gb", "0.1"]


class Fleet:
    def __init__(self, root: Path) -> None:
        self.dirs = [root / "d0", root / "d1"]
        self.procs = [start_worker(self._args(i)) for i in range(2)]
        for url, proc in self.procs:
            wait_healthy(url, proc)
        self.model = httpx.get(f"{self.url(0)}/v1/models").json()["data"][0]["id"]

    def _args(self, i: int) -> list[str]:
        return [*ARGS, "--disk-kv-dir", str(self.dirs[i])]

    def url(self, i: int) -> str:
        return self.procs[i][0]

    def restart(self, i: int) -> None:
        stop_group(self.procs[i][1])
        self.procs[i] = start_worker(self._args(i))
        wait_healthy(*self.procs[i])

    def stop(self) -> None:
        for _, proc in self.procs:
            stop_group(proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("erasure"))
    try:
        yield f
    finally:
        f.stop()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def complete(url: str, prompt: list[int], session: str | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": OUT, "temperature": 0, "ignore_eos": True}
    headers = {"X-Session-Id": session} if session else {}
    r = httpx.post(f"{url}/v1/completions", json=body | {"return_token_ids": True}, timeout=120,
                   headers=headers)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def out_ids(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def two_turns(url: str, session: str, first: list[int], seed: int) -> tuple[list[int], dict]:
    """Two turns of a session; returns the second prompt and its answer."""
    one = complete(url, first, session)
    second = first + out_ids(one) + tokens(seed, 20)
    return second, complete(url, second, session)


def computed_hashes(fleet: Fleet, prompt: list[int], resp: dict) -> list[bytes]:
    """The full blocks a turn computed: its prompt and output but the last output token."""
    ids = (prompt + out_ids(resp))[:-1]
    return hash_blocks(ids, root_hash(fleet.model), BS)


def block_path(directory: Path, h: bytes) -> Path:
    return directory / h.hex()[:2] / f"{h.hex()}.kvb"


def wait_on_disk(directory: Path, hashes: list[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(block_path(directory, h).exists() for h in hashes):
        assert time.monotonic() < deadline, "blocks never reached the disk tier"
        time.sleep(0.1)


def kv_windows(directory: Path, hashes: list[bytes]) -> list[bytes]:
    """Byte windows of these blocks' KV (unencrypted files: the body is the KV)."""
    out = []
    for h in hashes:
        body = block_path(directory, h).read_bytes()[PREFIX_BYTES:]
        step = len(body) // 16
        out += [body[i : i + 64] for i in range(0, len(body) - 64, step)]
    return [w for w in out if w.strip(b"\0")]


def scan(directory: Path, hashes: list[bytes], windows: list[bytes]) -> list[str]:
    """Every file under ``directory`` that names or holds one of ``hashes`` or ``windows``."""
    found = []
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        raw = path.read_bytes()
        if any(h.hex() in path.name or h in raw for h in hashes) or any(w in raw for w in windows):
            found.append(str(path))
    return found


def erase(url: str, path: str) -> httpx.Response:
    return httpx.delete(f"{url}{path}", timeout=120)


def test_session_erasure_leaves_no_byte_on_disk_and_keeps_shared_blocks(fleet):
    url, disk = fleet.url(0), fleet.dirs[0]
    shared_prefix = tokens(1, 3 * BS)  # the first 3 blocks of session a are also b's
    a_prompt, a_resp = two_turns(url, "a", shared_prefix + tokens(2, 60), 3)
    b_resp = complete(url, shared_prefix + tokens(4, 60), "b")
    c_resp = complete(url, tokens(5, 80), "c")
    a_blocks = computed_hashes(fleet, a_prompt, a_resp)
    b_blocks = computed_hashes(fleet, shared_prefix + tokens(4, 60), b_resp)
    c_blocks = computed_hashes(fleet, tokens(5, 80), c_resp)
    wait_on_disk(disk, a_blocks + b_blocks + c_blocks)
    a_only = [h for h in a_blocks if h not in b_blocks]
    assert len(a_only) == len(a_blocks) - 3
    windows = kv_windows(disk, a_only)
    assert scan(disk, a_only, windows)  # the scan does find them before

    r = erase(url, "/v1/sessions/a")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "kv.erasure" and body["session"] == "a"
    assert body["tenant"] == "default"
    assert body["kept_shared"] == 3
    assert body["removed"]["disk"] == len(a_only)
    assert body["removed"]["host"] == len(a_only)  # write-through: RAM holds them too

    assert scan(disk, a_only, windows) == []  # no file names or holds session a's KV
    assert all(block_path(disk, h).exists() for h in b_blocks + c_blocks)

    again = complete(url, a_prompt, "a")
    assert out_ids(again) == out_ids(a_resp)  # greedy: the same tokens, recomputed
    assert cached(again) == 3 * BS  # only the blocks b shares were kept

    r = erase(url, "/v1/sessions/a")  # idempotent; the return turn made blocks again
    assert r.status_code == 200 and r.json()["kept_shared"] == 3
    zeros = erase(url, "/v1/sessions/nobody").json()
    assert zeros["removed"] == dict.fromkeys(zeros["removed"], 0) and zeros["kept_shared"] == 0


def test_erased_session_returns_with_nothing_cached(fleet):
    url = fleet.url(0)
    prompt, resp = two_turns(url, "d", tokens(10, 70), 11)
    assert cached(resp) > 0  # the second turn reused the first
    wait_on_disk(fleet.dirs[0], computed_hashes(fleet, prompt, resp))
    body = erase(url, "/v1/sessions/d").json()
    assert body["kept_shared"] == 0 and body["removed"]["disk"] > 0
    again = complete(url, prompt, "d")
    assert cached(again) == 0
    assert out_ids(again) == out_ids(resp)


def test_router_erases_a_session_on_every_worker(fleet):
    router = RouterServer(RouterConfig.from_kwargs(workers=[fleet.url(0), fleet.url(1)]))
    dead = RouterServer(
        RouterConfig.from_kwargs(workers=[fleet.url(1), f"http://127.0.0.1:{free_port()}"])
    )
    try:
        prompt = tokens(20, 70)
        via_router = httpx.post(
            f"{router.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": OUT, "temperature": 0, "ignore_eos": True},
            headers={"X-Session-Id": "r"},
            timeout=120,
        )
        assert via_router.status_code == 200
        both = [complete(fleet.url(i), prompt, "r") for i in range(2)]  # a copy on each
        for i in range(2):
            wait_on_disk(fleet.dirs[i], computed_hashes(fleet, prompt, both[i]))
        hashes = computed_hashes(fleet, prompt, both[0])

        r = httpx.delete(f"{router.url}/v1/sessions/r", timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["complete"] and set(body["workers"]) == {fleet.url(0), fleet.url(1)}
        for i in range(2):
            assert body["workers"][fleet.url(i)]["removed"]["disk"] == len(hashes)
            assert scan(fleet.dirs[i], hashes, []) == []

        r = httpx.delete(f"{dead.url}/v1/sessions/r", timeout=120)
        assert r.status_code == 502
        body = r.json()
        assert not body["complete"]
        assert body["workers"][fleet.url(1)]["removed"]["disk"] == 0
        (down,) = [w for u, w in body["workers"].items() if u != fleet.url(1)]
        assert "unreachable" in down["error"]["message"]
    finally:
        router.stop()
        dead.stop()


def test_tenant_erasure_after_a_restart_removes_every_block_file(fleet):
    url = fleet.url(1)
    assert erase(url, "/v1/tenants/someone-else/kv").status_code == 403
    prompt, resp = two_turns(url, "t", tokens(30, 70), 31)
    complete(url, tokens(32, 50))  # a request without a session is the tenant's too
    wait_on_disk(fleet.dirs[1], computed_hashes(fleet, prompt, resp))
    fleet.restart(1)  # memory forgets; the disk tier and its owner log stay
    assert list(fleet.dirs[1].rglob("*.kvb"))
    body = erase(fleet.url(1), "/v1/tenants/default/kv").json()
    assert body["tenant"] == "default" and body["removed"]["disk"] > 0
    assert list(fleet.dirs[1].rglob("*.kvb")) == []
    assert [p for p in fleet.dirs[1].rglob("*") if p.is_file()] == []  # owner log too
    again = complete(fleet.url(1), prompt, "t")
    assert cached(again) == 0 and out_ids(again) == out_ids(resp)
