"""The prefill leg of a disaggregated request (``disagg``): the prefill worker computes the
prompt's KV and keeps it for the decode worker; on any failure the decode worker prefills."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from splitserve.common.responses_api import RESPONSES_PATH
from splitserve.router import disagg
from splitserve.router.forwarding import Forwarding, WorkerFailed
from splitserve.router.metrics import RouterMetrics
from splitserve.router.placement import Decision
from splitserve.router.response import UpstreamError
from splitserve.router.upstream import Pool
from splitserve.router.vouch import Vouch
from splitserve.router.worker import Worker


class PrefillLeg:
    def __init__(
        self,
        client: Pool,
        vouch: Vouch,
        metrics: RouterMetrics,
        failed: Callable[[Worker, str, Exception], None],
    ) -> None:
        self.client, self.vouch, self.metrics, self.failed = client, vouch, metrics, failed

    async def run(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        forwarding: Forwarding,
        decision: Decision,
    ) -> None:
        worker = decision.prefill
        if worker is None:
            outcome = "fallback" if decision.remote_prefill else "skipped"
            self.metrics.remote_prefills.labels(outcome).inc()
            return
        leg = disagg.responses_prefill_body if path == RESPONSES_PATH else disagg.prefill_body
        payload = json.dumps(leg(body)).encode()
        self.metrics.sent(worker.url, "prefill")
        params = None
        try:
            signed = self.vouch.headers(headers, forwarding.tenant, "POST", path, payload)
            r = await self.client.request("POST", worker.url, path, signed, payload)
            try:
                answer = await r.read()
            finally:
                r.release()
            if r.status >= 500:
                raise WorkerFailed(f"HTTP {r.status}")
            params = disagg.accepted_params(json.loads(answer)) if r.status == 200 else None
        except (UpstreamError, ValueError, WorkerFailed) as e:
            self.failed(worker, "prefill", e)
        # Without params the decode worker simply prefills locally: slower, never wrong.
        self.metrics.remote_prefills.labels("ok" if params else "fallback").inc()
        if params is not None:
            forwarding.prefill, forwarding.kv_params = worker, params
