"""The deployments ``splitserve bench compare`` knows by name: how each spends the cores
(collocated workers or prefill/decode pools) and the ``splitserve serve`` flags that make it
what it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Deployment:
    """One way to spend the cores: collocated workers or prefill/decode pools, and the
    extra ``splitserve serve`` flags (router policy, KV tiers) that make it what it is.

    ``engine`` runs in every worker (``builtin`` or ``vllm``). ``front`` is what clients
    talk to: ``splitserve`` (``serve``: our router in front of the pools), ``none`` (one
    worker on every core, no router) or ``vllm-router`` (the Rust ``vllm-router`` package
    with ``front_policy``, in front of the same workers ``serve`` would start)."""

    name: str
    disaggregated: bool
    serve_args: tuple[str, ...]
    about: str
    engine: str = "builtin"
    front: str = "splitserve"
    front_policy: str | None = None
    bind_all: bool = False  # front "none": the worker binds every core (else its defaults)

    def pools(self, workers: int) -> tuple[int, int]:
        """(prefill, decode) workers out of ``workers``: half and half when disaggregated."""
        if self.front == "none":
            return 0, 1
        if not self.disaggregated:
            return 0, workers
        if workers < 2:
            raise ValueError(f"{self.name} needs at least two workers (raise --cores)")
        return workers // 2, workers - workers // 2


SESSION_TIERS = ("--policy", "session", "--host-kv-gb", "2")

DEPLOYMENTS = {
    d.name: d
    for d in (
        Deployment(
            "collocated-rr", False, ("--policy", "round-robin"), "collocated, round-robin router"
        ),
        Deployment(
            "collocated-session", False, ("--policy", "session"), "collocated, session affinity"
        ),
        Deployment(
            "collocated-session-tiers",
            False,
            SESSION_TIERS,
            "collocated, session affinity, 2 GB host-RAM KV tier per worker",
        ),
        Deployment(
            "collocated-session-tiers-peer",
            False,
            (*SESSION_TIERS, "--kv-peer-fetch"),
            "collocated-session-tiers, a turn moved off its busy home pulls the session's KV "
            "from the home",
        ),
        Deployment(
            "collocated-session-tiers-sjf",
            False,
            (*SESSION_TIERS, "--scheduling-policy", "shortest-prefill"),
            "collocated-session-tiers, workers admit the shortest uncached prompt first",
        ),
        Deployment("disagg", True, ("--policy", "round-robin"), "P/D pools, round-robin decode"),
        Deployment("disagg-session", True, ("--policy", "session"), "P/D pools, session affinity"),
        Deployment(
            "disagg-session-tiers",
            True,
            SESSION_TIERS,
            "P/D pools, session affinity, 2 GB host-RAM KV tier per worker",
        ),
        Deployment(
            "builtin-single",
            False,
            (),
            "one splitserve worker, `splitserve serve`'s defaults (every core, no router)",
            front="none",
        ),
        Deployment(
            "llamacpp-single",
            False,
            (),
            "llama.cpp's server (llama-cpp-python) on the same GGUF, every core, no router",
            engine="llamacpp",
            front="none",
            bind_all=True,
        ),
        Deployment(
            "vllm-single",
            False,
            (),
            "one vLLM server, vLLM's own defaults (its CPU binding), no router",
            engine="vllm",
            front="none",
        ),
        Deployment(
            "vllm-single-all",
            False,
            (),
            "one vLLM server bound to every core, no router",
            engine="vllm",
            front="none",
            bind_all=True,
        ),
        Deployment(
            "vllm-rr",
            False,
            ("--policy", "round-robin"),
            "vLLM workers, splitserve's router, round-robin",
            engine="vllm",
        ),
        Deployment(
            "vllm-session",
            False,
            ("--policy", "session"),
            "vLLM workers, splitserve's router, session affinity",
            engine="vllm",
        ),
        Deployment(
            "vllm-kv-events",
            False,
            ("--policy", "kv-events"),
            "vLLM workers, splitserve's router placing turns by the workers' KV events",
            engine="vllm",
        ),
        Deployment(
            "vllm-disagg",
            True,
            ("--policy", "session"),
            "vLLM P/D pools (NixlConnector over UCX/TCP), splitserve's router, session affinity",
            engine="vllm",
        ),
    )
}
VLLM_ROUTER = "vllm-router:"  # vllm-router:POLICY, any of the package's policies


def parse_deployments(text: str) -> list[Deployment]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEPLOYMENTS and not n.startswith(VLLM_ROUTER)]
    if unknown or not names:
        known = ", ".join([*DEPLOYMENTS, f"{VLLM_ROUTER}POLICY"])
        raise ValueError(f"unknown deployment(s) {unknown}; known: {known}")
    return [DEPLOYMENTS.get(n) or vllm_router_deployment(n) for n in names]


def vllm_router_deployment(name: str) -> Deployment:
    """``vllm-router:POLICY``: vLLM workers behind the Rust ``vllm-router`` package."""
    from splitserve.cluster.vllm_router import VLLM_ROUTER_POLICIES

    policy = name.removeprefix(VLLM_ROUTER)
    if policy not in VLLM_ROUTER_POLICIES:
        raise ValueError(
            f"unknown vllm-router policy {policy!r}; known: {', '.join(VLLM_ROUTER_POLICIES)}"
        )
    about = f"vLLM workers behind the vllm-router package, policy {policy}"
    return Deployment(name, False, (), about, "vllm", "vllm-router", policy)
