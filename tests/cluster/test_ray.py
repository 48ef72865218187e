"""``splitserve serve --ray`` on a real two-node Ray cluster (tests/ray_nodes.py): placement
by label and spread, the OpenAI API through two router replicas, P/D across nodes, every HTTP
leg over TLS by the deployment's own CA (``--tls``), and,
under a steady load of streamed session turns, a killed worker, a killed router replica,
scaling up and down and a lost node, with no failed request; then an autoscaled deployment
placing by KV events."""

from __future__ import annotations

import glob
import json
import os
import queue
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil
import pytest
from procs import die_with_parent, metric, stop_group
from ray_nodes import RayCluster

pytest.importorskip("ray")
pytestmark = pytest.mark.ray  # make test-ray

PROMPT = "Explain, step by step, how a hash table handles collisions. " * 8
HEAD, NODE_B = "127.0.0.2", "127.0.0.3"


class Deployment:
    def __init__(
        self,
        cluster,
        launcher,
        routers: list[str],
        name: str = "splitserve",
        verify: ssl.SSLContext | bool = True,
    ):
        self.cluster, self.launcher, self.routers, self.name = cluster, launcher, routers, name
        self.verify = verify  # with --tls: the deployment's CA
        self._watch: subprocess.Popen | None = None  # `cluster status --json --watch`
        self._watch_err = tempfile.TemporaryFile()
        self._latest: dict | None = None
        self._fresh = threading.Condition()

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "splitserve.cli", "cluster", *args]
        argv += ["--ray", self.cluster.address]
        if "--ray-name" not in args:
            argv += ["--ray-name", self.name]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    def status(self) -> dict:
        """The first status read after this call, from one `cluster status --json --watch`
        (a `cluster status` per poll costs a Python start and a Ray connection each)."""
        asked = time.time()
        if self._watch is None:
            argv = [sys.executable, "-m", "splitserve.cli", "cluster", "status", "--json"]
            argv += ["--watch", "1", "--ray", self.cluster.address, "--ray-name", self.name]
            self._watch = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=self._watch_err, text=True,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
            threading.Thread(target=self._read_watch, args=(self._watch,), daemon=True).start()
        deadline = time.monotonic() + 120
        with self._fresh:
            while self._latest is None or self._latest["time"] < asked:
                if self._watch.poll() is not None or time.monotonic() > deadline:
                    self._watch_err.seek(0)
                    raise AssertionError(f"no status: {self._watch_err.read().decode()}")
                self._fresh.wait(1.0)
            assert "not json" not in self._latest, self._latest
            return json.loads(json.dumps(self._latest))  # the caller's own copy

    def _read_watch(self, watch: subprocess.Popen) -> None:
        for line in watch.stdout:
            with self._fresh:
                try:
                    self._latest = json.loads(line)
                except ValueError:  # status() fails on it
                    self._latest = {"time": float("inf"), "not json": line}
                self._fresh.notify_all()

    def stop_watch(self) -> None:
        if self._watch is not None:
            stop_group(self._watch)
            self._watch = None

    def procs(self, role: str | None = None) -> list[dict]:
        data = self.status()
        every = [*data["workers"], *data["routers"]]
        return [p for p in every if role is None or p["role"] == role]

    def wait(self, check, timeout: float = 240.0) -> list[dict]:
        """Poll ``status`` until ``check(processes)`` holds; the processes then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            procs = self.procs()
            if check(procs):
                return procs
            time.sleep(1.0)
        raise TimeoutError(f"not reached in {timeout:.0f}s: {self.procs()}")


def _describe(proc: psutil.Process, listed: list[dict]) -> str:
    """A leftover process as the deployment listed it, with what the OS says of it."""
    entry = next((p for p in listed if p["pid"] == proc.pid), {})
    try:
        started = time.strftime("%H:%M:%S", time.localtime(proc.create_time()))
        return f"{entry} ppid {proc.ppid()} started {started}: {' '.join(proc.cmdline())[:300]}"
    except psutil.Error as e:
        return f"{entry}: {e}"


def all_ready(count: int, restarted: dict | None = None):
    """All ``count`` processes ready (and ``restarted``'s slot started again since)."""

    def check(procs: list[dict]) -> bool:
        if len(procs) != count or any(p["state"] != "ready" for p in procs):
            return False
        if restarted is None:
            return True
        back = next((p for p in procs if p["name"] == restarted["name"]), None)
        return back is not None and back["restarts"] > restarted["restarts"]

    return check


@pytest.fixture(scope="module")
def cluster():
    cluster = RayCluster([(6, "a"), (2, "b")])
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def serve(cluster: RayCluster, args: list[str], routers: int = 1):
    """``serve --ray`` with ``args`` until the caller is done; stopping it must leave no
    process of it behind."""
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--ray", cluster.address]
    argv += ["--port", "0", "--threads-per-worker", "1", "--kv-cache-gb", "0.25"]
    argv += ["--remote-prefill-threshold", "64", "--ready-timeout", "400", *args]
    launcher = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in launcher.stdout], daemon=True).start()
    deployment = None
    try:
        urls: list[str] = []
        verify: ssl.SSLContext | bool = True
        while len(urls) < routers:
            line = lines.get(timeout=500)
            if "serving the OpenAI API at" in line:
                urls.append(line.split(" at ")[1].split("/v1")[0])
            elif "clients trust" in line:
                verify = ssl.create_default_context(cafile=line.split("trust ")[1].split(",")[0])
        name = args[args.index("--ray-name") + 1] if "--ray-name" in args else "splitserve"
        deployment = Deployment(cluster, launcher, urls, name, verify)
        yield deployment
        listed = deployment.procs()
        pids = [p["pid"] for p in listed if p["pid"] is not None]  # a slot still starting has none
        deployment.stop_watch()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 0
        gone, alive = psutil.wait_procs([_proc(p) for p in pids if _proc(p)], timeout=30)
        assert not alive, f"left behind: {[_describe(p, listed) for p in alive]}"
    finally:
        if deployment is not None:
            deployment.stop_watch()
        stop_group(launcher)


@pytest.fixture(scope="module")
def deployment(cluster, tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk")
    args = ["--prefill", "1", "--decode", "2", "--routers", "2", "--node-label", "prefill:pool=a"]
    args += ["--host-kv-gb", "0.25", "--disk-kv-dir", str(disk), "--tls"]
    yield from serve(cluster, args, routers=2)


def _proc(pid: int) -> psutil.Process | None:
    """The running process ``pid``, or None. (``psutil.Process(None)`` would be this one.)"""
    assert pid is not None
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


class Load:
    """Clients streaming two-turn sessions through the routers until stopped."""

    def __init__(
        self,
        routers: list[str],
        clients: int = 2,
        max_tokens: int = 12,
        prompt: str = PROMPT,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.routers, self.max_tokens, self.prompt = routers, max_tokens, prompt
        self.verify = verify
        self.done, self.failures = 0, []
        self.workers: set[str] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    def _run(self, client: int) -> None:
        n = 0
        with httpx.Client(timeout=180, verify=self.verify) as http:
            while not self._stop.is_set():
                n += 1
                content = f"Session {client}-{n}-{time.monotonic()}. {self.prompt}"
                messages = [{"role": "user", "content": content}]
                for turn in range(2):
                    router = self.routers[(client + n + turn) % len(self.routers)]
                    text = self._turn(http, router, f"load-{client}-{n}", messages)
                    if text is None:
                        break
                    messages += [{"role": "assistant", "content": text}]
                    messages += [{"role": "user", "content": "And then?"}]

    def _turn(self, http: httpx.Client, router: str, session: str, messages) -> str | None:
        body = {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0}
        body["stream"] = True
        text, ended = "", False
        try:
            with http.stream(
                "POST", f"{router}/v1/chat/completions", json=body,
                headers={"x-session-id": session},
            ) as r:  # fmt: skip
                if r.status_code != 200:
                    self.failures.append(f"{router}: {r.status_code} {r.read()!r}")
                    return None
                self.workers.add(r.headers.get("x-splitserve-decode-worker", ""))
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        ended = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.failures.append(f"{router}: {chunk['error']}")
                            return None
                        text += chunk["choices"][0]["delta"].get("content") or ""
        except httpx.HTTPError as e:
            self.failures.append(f"{router}: {e!r}")
            return None
        if not ended:
            self.failures.append(f"{router}: the stream ended without [DONE]")
            return None
        self.done += 1
        return text

    def wait_done(self, more: int, timeout: float = 240.0) -> None:
        target, deadline = self.done + more, time.monotonic() + timeout
        while self.done < target and time.monotonic() < deadline:
            time.sleep(0.5)
        assert self.done >= target, f"only {self.done} of {target} turns in {timeout:.0f}s"


def test_placement_by_label_and_spread(deployment):
    data = deployment.status()
    nodes = {n["ip"]: n for n in data["nodes"]}
    assert set(nodes) == {HEAD, NODE_B} and all(n["alive"] for n in nodes.values())
    assert nodes[HEAD]["labels"] == {"pool": "a"} and nodes[NODE_B]["labels"] == {"pool": "b"}
    roles = {w["name"]: w for w in data["workers"]}
    assert set(roles) == {"prefill-0", "decode-0", "decode-1"}
    assert roles["prefill-0"]["node_ip"] == HEAD  # --node-label prefill:pool=a
    assert NODE_B in {w["node_ip"] for w in data["workers"]}  # the pools spread
    for p in [*data["workers"], *data["routers"]]:  # each binds its node's own address
        assert p["url"].startswith(f"https://{p['node_ip']}:") and p["state"] == "ready"
    for url in [deployment.routers[0], roles["decode-0"]["url"]]:  # by the deployment's CA
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", timeout=10)
        assert httpx.get(f"{url}/health", timeout=10, verify=deployment.verify).status_code == 200
    assert {r["node_ip"] for r in data["routers"]} == {HEAD}  # routers on the head
    assert sorted(r["url"] for r in data["routers"]) == sorted(deployment.routers)


def test_openai_client_through_each_router_matches_offline(deployment):
    from openai import OpenAI

    from splitserve import LLM, SamplingParams

    messages = [{"role": "user", "content": "Name three primary colours."}]
    expected = LLM().chat(messages, SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    for router in deployment.routers:
        http = httpx.Client(verify=deployment.verify)
        client = OpenAI(base_url=f"{router}/v1", api_key="unused", http_client=http)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=messages, max_tokens=10, temperature=0
        )
        assert reply.choices[0].message.content == expected.text


def test_prefill_and_decode_on_different_nodes(deployment):
    """A long prompt is computed by the prefill worker on the head and its KV pulled over
    tcp by a decode worker on the other node, at that node's address."""
    router = deployment.routers[0]
    decode_b = [w["url"] for w in deployment.procs("decode") if w["node_ip"] == NODE_B]
    assert decode_b, "no decode worker on node b"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    session = next(  # a session the ring places on node b
        s
        for s in (f"pd-{i}" for i in range(200))
        if httpx.post(
            f"{router}/v1/chat/completions",
            json=body,
            headers={"x-session-id": s},
            timeout=60,
            verify=deployment.verify,
        ).headers["x-splitserve-decode-worker"]
        in decode_b
    )
    received = metric(decode_b[0], "splitserve:kv_blocks_received_total", verify=deployment.verify)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(
        f"{router}/v1/chat/completions",
        json=body,
        headers={"x-session-id": session},
        timeout=120,
        verify=deployment.verify,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-splitserve-prefill-worker"].startswith(f"https://{HEAD}:")
    assert r.headers["x-splitserve-decode-worker"] == decode_b[0]
    assert (
        metric(decode_b[0], "splitserve:kv_blocks_received_total", verify=deployment.verify)
        > received
    )


def test_killed_worker_is_replaced_where_it_was_and_no_request_fails(deployment):
    victim = next(w for w in deployment.procs("decode") if w["name"] == "decode-0")
    with Load(deployment.routers, verify=deployment.verify) as load:
        load.wait_done(2)
        os.kill(victim["pid"], signal.SIGKILL)
        procs = deployment.wait(all_ready(5, restarted=victim))
        load.wait_done(4)  # and the load goes on through the replacement
    back = next(p for p in procs if p["name"] == "decode-0")
    assert back["pid"] != victim["pid"] and back["restarts"] == victim["restarts"] + 1
    assert (back["url"], back["node_ip"]) == (victim["url"], victim["node_ip"])  # same node
    assert load.failures == []


def test_killed_router_replica_is_replaced_and_the_other_serves_on(deployment):
    victim = next(r for r in deployment.procs("router") if r["url"] == deployment.routers[0])
    with Load(deployment.routers[1:], verify=deployment.verify) as load:
        load.wait_done(1)
        os.kill(victim["pid"], signal.SIGKILL)
        procs = deployment.wait(all_ready(5, restarted=victim))
        load.wait_done(2)
    back = next(p for p in procs if p["name"] == victim["name"])
    assert back["url"] == victim["url"] and back["pid"] != victim["pid"]
    assert load.failures == []
    r = httpx.get(
        f"{victim['url']}/health", timeout=10, verify=deployment.verify
    )  # back, with the workers it had
    assert r.status_code == 200 and r.json()["workers"] == 3


def test_scale_up_then_down_under_load(deployment):
    with Load(deployment.routers, clients=3, verify=deployment.verify) as load:
        load.wait_done(1)
        out = deployment.cli("scale", "--decode", "3")
        assert out.returncode == 0 and "decode 3" in out.stdout, out.stderr
        procs = deployment.wait(all_ready(6))
        new = next(p for p in procs if p["name"] == "decode-2")
        deadline = time.monotonic() + 240
        while new["url"] not in load.workers and time.monotonic() < deadline:
            time.sleep(0.5)  # sessions the ring now gives the new worker reach it
        assert new["url"] in load.workers
        out = deployment.cli("scale", "--decode", "2")
        assert out.returncode == 0, out.stderr
        deployment.wait(all_ready(5))
        load.wait_done(2)
    assert load.failures == []
    assert _proc(new["pid"]) is None  # drained, then stopped


def test_lost_node_is_replaced_elsewhere_and_no_request_fails(deployment):
    on_b = [w for w in deployment.procs() if w["node_ip"] == NODE_B]
    assert on_b
    with Load(deployment.routers, verify=deployment.verify) as load:
        load.wait_done(2)
        deployment.cluster.nodes[1].kill()
        procs = deployment.wait(
            lambda ps: all_ready(5)(ps) and all(p["node_ip"] == HEAD for p in ps), timeout=300
        )
        load.wait_done(4)
    assert load.failures == []
    # The lost hosts could not remove their TLS files; their replacements did (one machine).
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "splitserve-ray-tls-*")):
        with open(os.path.join(d, "owner")) as f:
            assert psutil.pid_exists(int(f.read())), f"{d} outlived its host"
    moved = {p["name"]: p for p in procs}
    for w in on_b:  # on the head now, at the head's address, in every router's ring
        assert moved[w["name"]]["url"].startswith(f"https://{HEAD}:")
    for router in deployment.routers:
        health = httpx.get(f"{router}/health", timeout=10, verify=deployment.verify)
        assert health.json()["workers"] == 3


def test_cluster_commands_refuse_bad_input(deployment):
    out = deployment.cli("scale", "--decode", "0")
    assert out.returncode == 2 and "--decode must stay >= 1" in out.stderr
    out = deployment.cli("scale")
    assert out.returncode == 2 and "give --prefill N and/or --decode M" in out.stderr
    out = deployment.cli("status", "--ray-name", "nope")
    assert out.returncode == 2 and "no splitserve deployment named 'nope'" in out.stderr
    text = deployment.cli("status")
    assert text.returncode == 0 and "decode-0" in text.stdout and "sessions" in text.stdout
    once = deployment.cli("status", "--json")  # one document, as --watch prints each
    data = json.loads(once.stdout)
    assert once.returncode == 0 and {w["name"] for w in data["workers"]} == {
        w["name"] for w in deployment.status()["workers"]
    }


def test_autoscale_moves_the_split_as_the_simulator_predicts_when_prompts_grow(cluster):
    """Short prompts, then long ones, under load: each decision is the simulator's best split
    for the mix the workers served (recomputed here), and the deployment ends on the best
    split for the long prompts, removing a worker only once its replacement serves, with no
    failed request."""
    from splitserve.cluster.autoscale import Mix, Planner
    from splitserve.workload.metrics import SLO

    slo = "ttft:3000,tpot:250"
    args = ["--ray-name", "auto", "--prefill", "1", "--decode", "1", "--autoscale"]
    args += ["--policy", "kv-events"]  # a decode worker that joins is subscribed to as well
    args += ["--autoscale-interval", "10", "--autoscale-slo", slo, "--autoscale-host-cores", "2"]
    args += ["--autoscale-patience", "1"]  # hysteresis: tests/cluster/test_autoscale.py
    planner = Planner(SLO.parse(slo), host_cores=2, remote_prefill_threshold=64)
    for d in serve(cluster, args):
        with Load(d.routers, clients=1, max_tokens=16, prompt="Say hi.") as load:
            _decisions(d, 2)
        with Load(d.routers, clients=2, max_tokens=8, prompt=PROMPT * 8) as long_load:
            decisions = _decisions(d, 4, until=lambda ds: any(x["action"] == "scale" for x in ds))
            last = decisions[-1]
            assert last["action"] == "keep" or last["action"] == "scale"
            procs = d.wait(lambda ps: all(p["state"] == "ready" for p in ps), timeout=240)
        assert load.failures == [] and long_load.failures == []
        for x in decisions:
            if x["action"] == "keep" and not x["scores"]:
                continue  # too few requests to judge
            mix = Mix(**{k: x["mix"][k] for k in Mix.__slots__})
            scores = planner.scores(mix, 2)
            assert {f"{p}:{q}": list(v) for (p, q), v in scores.items()} == {
                k: list(v) for k, v in x["scores"].items()
            }
            if x["action"] in ("wait", "scale"):
                assert tuple(x["best"]) == max(scores, key=lambda s: scores[s])
        scaled = [x for x in decisions if x["action"] == "scale"]
        assert scaled, decisions
        split = (
            sum(p["role"] == "prefill" for p in procs),
            sum(p["role"] == "decode" for p in procs),
        )
        assert split == tuple(scaled[-1]["best"])
        # Make before break: each removed worker served until its replacement was ready.
        events = d.status()["events"]
        resizes = _resizes(events)
        assert resizes, "\n".join(events)
        for added, retired in resizes:
            assert added and retired, "\n".join(events)
            ready = max(_first(events, f" {name} ready", after=i) for name, i in added)
            for name, i in retired:
                assert i < ready < _first(events, f" draining {name} ", after=i), "\n".join(events)
        with Load(d.routers, clients=1, max_tokens=4, prompt="Say hi.") as load:
            load.wait_done(4)
        served = [w for w in d.status()["workers"] if w["role"] == "decode" and w["sessions"]]
        assert served and all(w["kv_blocks_indexed"] > 0 for w in served), served


def _resizes(events: list[str]) -> list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]:
    """Per autoscaling resize in the controller's events: the (worker, event index) of the
    workers it added and of those it retired."""
    out: list[tuple[list, list]] = []
    for i, e in enumerate(events):
        if " autoscale scale: " in e:
            out.append(([], []))
        elif out and (" adding " in e or " retiring " in e):
            name = e.split(" adding " if " adding " in e else " retiring ")[1].split()[0]
            out[-1][0 if " adding " in e else 1].append((name.rstrip(":"), i))
    return out


def _first(events: list[str], text: str, after: int) -> int:
    """The index of the first event after ``after`` that contains ``text``."""
    return next(i for i, e in enumerate(events) if i > after and text in e)


def _decisions(d: Deployment, count: int, until=None, timeout: float = 300.0) -> list[dict]:
    """The autoscaler's decisions once there are ``count`` of them (and ``until`` holds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        decisions = d.status()["decisions"]
        if len(decisions) >= count and (until is None or until(decisions)):
            return decisions
        time.sleep(2.0)
    raise TimeoutError(f"decisions so far: {d.status()['decisions']}")
