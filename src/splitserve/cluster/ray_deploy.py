"""A deployment on a Ray cluster: its workers and router replicas, kept alive and resized.

The controller owns one ``ProcessHost`` actor per process (``cluster.ray_host``) and a loop
that, every second:

- replaces a process that exited or whose node died: on the same node when that node lives
  (same ports, so the same URL, and the same disk-tier directory, so its sessions' KV
  survives), else wherever the role's resources and label allow;
- makes every router replica's membership (``POST/DELETE /workers``) match the workers that
  are healthy now; a replica that restarted is brought up to date the same way;
- stops drained workers: a worker being removed leaves every router first, and stops once it
  has had no request for two checks in a row.

Slot names (``decode-1``) are stable: a replacement keeps its slot's name, its role, its
disk-tier subdirectory and its access log.

With ``plan.tls`` the controller makes the deployment's CA (``cluster.tls.DeploymentCA``) and
keeps its key in memory; each process gets a certificate for the address of the node it
landed on, and the controller reaches every process over HTTPS verified by that CA.
"""

from __future__ import annotations

import ssl
import sys
import threading
import time
from typing import Any

import httpx

from splitserve.cluster.local import healthy
from splitserve.cluster.ray_host import ProcessHost
from splitserve.cluster.ray_plan import (
    ROUTER,
    RayPlan,
    Slot,
    actor_options,
    binds_router_port,
    slot_command,
    slot_ports,
)

LOOP_S = 1.0
_STAYING = ("starting", "ready")  # the states of a worker that is not leaving
PLACE_WAIT_S = 10.0  # a launch unplaced this long lets the retiring go (see _start_drains)


class Controller:
    """Runs a ``RayPlan``; Ray calls its methods from several threads (``max_concurrency``)."""

    def __init__(self, plan: RayPlan) -> None:
        self.plan = plan
        self._lock = threading.RLock()
        self._slots: dict[str, Slot] = {}
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self.log: list[str] = []
        self._ca = None
        self._ca_context: ssl.SSLContext | None = None  # verifies every process with --tls
        if plan.tls:
            from splitserve.cluster.tls import DeploymentCA
            from splitserve.common.tls import client_context

            self._ca = DeploymentCA()
            self._ca_context = client_context(cadata=self._ca.ca_pem)
        self._autoscaler = None
        if plan.autoscale is not None:
            from splitserve.cluster.autoscale import Autoscaler, Planner

            key = plan.env.get("SPLITSERVE_API_KEY")
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            planner = Planner(**plan.autoscale)
            self._autoscaler = Autoscaler(
                planner, plan.autoscale_interval, headers, verify=self._verify
            )

    @property
    def _verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify`` for the deployment's processes."""
        return True if self._ca_context is None else self._ca_context

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> list[str]:
        """Start every worker, then the router replicas; the routers' URLs once all are
        healthy. Raises RuntimeError when one does not become healthy in time."""
        t = self.plan.topology
        workers = [Slot(f"prefill-{i}", "prefill") for i in range(t.prefill)]
        workers += [Slot(f"decode-{i}", "decode") for i in range(t.decode)]
        with self._lock:
            for slot in workers:
                self._slots[slot.name] = slot
                self._launch(slot)
        self._wait_ready(workers)
        routers = [Slot(f"{ROUTER}-{i}", ROUTER) for i in range(self.plan.routers)]
        with self._lock:
            for slot in routers:
                self._slots[slot.name] = slot
                self._launch(slot)
        self._wait_ready(routers)
        self._loop = threading.Thread(target=self._run, name="splitserve-ray", daemon=True)
        self._loop.start()
        return self.router_urls()

    def stop(self) -> None:
        """Stop the loop, then every process: routers first, so no request reaches a
        stopping worker."""
        self._stop.set()
        if self._loop is not None:
            self._loop.join(timeout=30)
        with self._lock:
            slots = sorted(self._slots.values(), key=lambda s: s.role != ROUTER)
        for slot in slots:
            self._end(slot)

    def router_urls(self) -> list[str]:
        with self._lock:
            return [s.url for s in self._slots.values() if s.role == ROUTER and s.url]

    def slots(self) -> list[dict[str, Any]]:
        """Every process: name, role, url, node, pid, state and restarts."""
        with self._lock:
            return [
                {
                    "name": s.name,
                    "role": s.role,
                    "url": s.url,
                    "node_id": s.info.get("node_id"),
                    "node_ip": s.info.get("ip"),
                    "pid": s.info.get("pid"),
                    "state": s.state,
                    "restarts": s.restarts,
                }
                for s in self._slots.values()
            ]

    def ca_pem(self) -> bytes | None:
        """The deployment's CA certificate (PEM) with ``--tls``: what clients trust."""
        return None if self._ca is None else self._ca.ca_pem

    def keys(self) -> tuple[str, str | None]:
        """The routers' admin key and the workers' API key (None: open), for ``status``."""
        return self.plan.admin_key, self.plan.env.get("SPLITSERVE_API_KEY")

    def decisions(self) -> list[dict[str, Any]]:
        """The autoscaler's decisions, oldest first (none without ``--autoscale``)."""
        if self._autoscaler is None:
            return []
        return [d.as_dict() for d in self._autoscaler.decisions]

    def events(self) -> list[str]:
        """Every replacement, resize and decision, with its reason, oldest first."""
        with self._lock:
            return list(self.log)

    # -- resizing ----------------------------------------------------------------------

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict[str, int]:
        """Set the pools' sizes: new workers join once healthy; removed ones drain first."""
        if decode is not None and decode < 1:
            raise ValueError("--decode must stay >= 1: the routers need a decode worker")
        if prefill is not None and prefill < 0:
            raise ValueError(f"--prefill must be >= 0, got {prefill}")
        with self._lock:
            for role, want in (("prefill", prefill), ("decode", decode)):
                if want is not None:
                    self._resize(role, want)
            return self.sizes()

    def sizes(self) -> dict[str, int]:
        """Each pool's size, not counting workers that are draining."""
        with self._lock:
            live = [s for s in self._slots.values() if s.state in ("starting", "ready")]
            return {r: sum(s.role == r for s in live) for r in ("prefill", "decode")}

    def _resize(self, role: str, want: int) -> None:
        """Launch or remove ``role`` workers. Removed ones keep serving ("retiring") while
        any worker starts, so that a change of split never leaves the routers short."""
        live = [s for s in self._slots.values() if s.role == role and s.state in _STAYING]
        live.sort(key=lambda s: int(s.name.rsplit("-", 1)[1]))
        for slot in live[want:]:  # the newest go first
            slot.state = "retiring"
            self._note(f"retiring {slot.name} ({slot.url}): scaling {role} to {want}")
        taken = {int(s.name.rsplit("-", 1)[1]) for s in self._slots.values() if s.role == role}
        index = 0
        for _ in range(want - len(live)):
            while index in taken:
                index += 1
            taken.add(index)
            slot = Slot(f"{role}-{index}", role)
            self._slots[slot.name] = slot
            self._note(f"adding {slot.name}: scaling {role} to {want}")
            self._launch(slot)

    # -- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(LOOP_S):
            try:
                self.reconcile()
                if self._autoscaler is not None:
                    self._autoscale()
            except Exception as e:  # one bad pass must not end the healing
                print(f"splitserve ray: reconcile failed: {e!r}", file=sys.stderr, flush=True)

    def _autoscale(self) -> None:
        with self._lock:
            workers = self._member_urls()
            settled = all(s.state == "ready" for s in self._slots.values())
            sizes = self.sizes()
        split = (sizes["prefill"], sizes["decode"])
        decision = self._autoscaler.step(workers, split, settled)
        if decision is None:
            return
        self._note(f"autoscale {decision.action}: {decision.reason}")
        if decision.action == "scale":
            self.scale(*decision.best)

    def reconcile(self) -> None:
        """One pass: replace the dead, mark the healthy ready, sync routers, end drains."""
        with self._lock:
            slots = [s for s in self._slots.values() if s.state != "stopped"]
        for slot in slots:
            if self._stop.is_set():
                return
            if not self._place(slot):
                continue  # still waiting for a node with room
            if self._dead(slot):
                self._replace(slot)
            elif slot.state == "starting" and healthy(slot.url, ca=self._ca_context):
                with self._lock:  # a scale-down may have marked it draining meanwhile
                    if slot.state != "starting":
                        continue
                    slot.state = "ready"
                self._note(f"{slot.name} ready at {slot.url} on node {slot.info['ip']}")
        self._start_drains()
        self._sync_routers()
        for slot in slots:
            if slot.state == "draining" and self._drained(slot):
                self._end(slot)
                with self._lock:
                    self._slots.pop(slot.name, None)
                self._note(f"{slot.name} drained and stopped")

    def _start_drains(self) -> None:
        """Retiring workers start to drain once no worker is starting (their replacements,
        if the resize launched any, are serving), or once a starting one has waited
        ``PLACE_WAIT_S`` for a node with room (the retiring may hold that room)."""
        now = time.monotonic()
        with self._lock:
            starting = [s for s in self._slots.values() if s.role != ROUTER]
            starting = [s for s in starting if s.state == "starting"]
            if any(s.placing is None or now - s.since < PLACE_WAIT_S for s in starting):
                return
            retiring = [s for s in self._slots.values() if s.state == "retiring"]
            for slot in retiring:
                slot.state, slot.idle_checks, slot.since = "draining", 0, now
        for slot in retiring:
            self._note(f"draining {slot.name} ({slot.url})")

    def _dead(self, slot: Slot) -> bool:
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        try:
            return ray.get(slot.actor.poll.remote(), timeout=10) is not None
        except (ActorUnavailableError, GetTimeoutError):
            return False  # unreachable for now; Ray declares the node dead or it comes back
        except RayActorError:
            return True

    def _replace(self, slot: Slot) -> None:
        import ray

        where = slot.info.get("ip", "?")
        self._note(f"{slot.name} ({slot.url}) on node {where} died; replacing it")
        try:  # an actor that lives removes its process's files
            ray.get(slot.actor.stop.remote(), timeout=10)
        except Exception:
            pass
        try:
            ray.kill(slot.actor)
        except Exception:
            pass
        slot.restarts += 1
        leaving = slot.state if slot.state in ("retiring", "draining") else None
        self._launch(slot, prefer=slot.info)
        if leaving:  # it was leaving anyway
            slot.state = leaving

    def _launch(self, slot: Slot, prefer: dict[str, Any] | None = None) -> None:
        """Ask Ray for ``slot``'s actor; ``prefer``: the node (and ports) it had. The process
        starts once the actor is placed (``_place``): a pool waiting for resources holds up
        no other slot."""
        slot.state, slot.prefer, slot.info = "starting", prefer, {}
        slot.since = time.monotonic()
        slot.actor = (
            _actor_class().options(**actor_options(self.plan, slot.role, prefer)).remote(slot.name)
        )
        slot.placing = slot.actor.node.remote()

    def _place(self, slot: Slot) -> bool:
        """Start ``slot``'s process if its actor has been placed; whether it runs."""
        import ray

        if slot.placing is None:
            return True
        done, _ = ray.wait([slot.placing], timeout=0)
        if not done:
            return False
        try:
            where, prefer = ray.get(slot.placing), slot.prefer
        except ray.exceptions.RayActorError:  # e.g. its node died before Ray said so
            self._launch(slot, prefer=slot.prefer)
            return False
        same = prefer is not None and where["node_id"] == prefer.get("node_id")
        ports = dict(prefer["ports"]) if same else slot_ports(self.plan, slot)
        if slot.role == ROUTER and binds_router_port(self.plan, slot):
            ports["port"] = self.plan.router_port
        with self._lock:  # all a router may need; its first sync drops the unhealthy
            workers = [s for s in self._slots.values() if s.role != ROUTER and s.url]
            members = {s.url: s.role for s in workers}
            events = {s.url: s.events for s in workers if s.events}
        argv, env = slot_command(self.plan, slot, members, events)
        files = None if self._ca is None else self._ca.issue([where["ip"]])
        info = ray.get(slot.actor.start.remote(argv, env, ports, files), timeout=60)
        slot.info = {**info, "tls": self._ca is not None}
        slot.placing = None
        return True

    def _member_urls(self) -> dict[str, str]:
        """URL -> role of the workers every router should have: the healthy ones, and those
        that keep serving until their replacements are up."""
        return {
            s.url: s.role
            for s in self._slots.values()
            if s.role != ROUTER and s.state in ("ready", "retiring") and s.url
        }

    def _sync_routers(self) -> None:
        with self._lock:
            want = self._member_urls()
            events = {s.url: s.events for s in self._slots.values() if s.url in want}
            routers = [s for s in self._slots.values() if s.role == ROUTER and s.state == "ready"]
        head = {"Authorization": f"Bearer {self.plan.admin_key}"}
        for router in routers:
            try:
                with httpx.Client(headers=head, timeout=5, verify=self._verify) as http:
                    r = http.get(f"{router.url}/workers")
                    have = {w["url"]: w["role"] for w in r.json()["workers"]}
                    for url in have.keys() - want.keys():
                        http.delete(f"{router.url}/workers/{url}")
                    for url in want.keys() - have.keys():
                        body = {"url": url, "role": want[url]}
                        if events.get(url):
                            body["kv_events"] = events[url]
                        http.post(f"{router.url}/workers", json=body)
            except (httpx.HTTPError, ValueError, KeyError):
                continue  # down or restarting: the next pass, or its restart, catches up

    def _drained(self, slot: Slot) -> bool:
        """Idle on two checks in a row after leaving the routers, or out of time (a stream
        still running then migrates to another worker)."""
        if slot.url is None or time.monotonic() - slot.since > self.plan.drain_timeout:
            return True
        load = worker_load(slot.url, self.plan.env.get("SPLITSERVE_API_KEY"), self._verify)
        # None: gone, nothing left to drain. Busy: requests in the engine or still being
        # answered, or blocks leased to decode workers that have not pulled them yet.
        keys = ("running", "waiting", "requests", "kv_blocks_leased")
        busy = load is not None and sum(load.get(k) or 0 for k in keys) > 0
        slot.idle_checks = 0 if busy else slot.idle_checks + 1
        return slot.idle_checks >= 2

    def _end(self, slot: Slot) -> None:
        import ray

        try:
            if slot.placing is None:  # else nothing runs yet
                ray.get(slot.actor.stop.remote(), timeout=30)
        except Exception:
            pass  # its actor is gone: so is the process (it dies with the actor)
        try:
            ray.kill(slot.actor)
        except Exception:
            pass
        slot.state = "stopped"

    def _wait_ready(self, slots: list[Slot]) -> None:
        deadline = time.monotonic() + self.plan.ready_timeout
        pending = list(slots)
        while pending:
            for slot in pending:
                if self._place(slot) and self._dead(slot):
                    raise RuntimeError(f"{slot.name} exited before it became healthy")
            pending = [
                s for s in pending if s.url is None or not healthy(s.url, ca=self._ca_context)
            ]
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise RuntimeError(f"{names} did not become healthy")
            time.sleep(0.2)
        for slot in slots:
            slot.state = "ready"

    def _note(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        with self._lock:
            self.log.append(stamped)
        print(f"splitserve ray: {line}", file=sys.stderr, flush=True)


def worker_load(
    url: str, key: str | None, verify: ssl.SSLContext | bool = True
) -> dict[str, Any] | None:
    """A worker's ``running``, ``waiting`` and ``kv_usage`` (0-1): from its ``/load``, or a
    vLLM server's from its ``/metrics``; None when it does not answer."""
    from splitserve.router.health import KV_USAGE_SCALE, load_from_metrics

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(headers=headers, timeout=5, verify=verify) as http:
            r = http.get(f"{url}/load")
            load = r.json() if r.status_code == 200 else {}
            if "running" in load:
                return load
            # vLLM answers /load with its own shape (server_load), or 404 without tracking
            report = load_from_metrics(http.get(f"{url}/metrics").text)
    except (httpx.HTTPError, ValueError):
        return None
    if report is None:
        return None
    usage = report.kv_blocks_used / KV_USAGE_SCALE if report.kv_blocks_total else None
    return {"running": report.running, "waiting": report.waiting, "kv_usage": usage}


def _actor_class():
    import ray

    return ray.remote(ProcessHost)
