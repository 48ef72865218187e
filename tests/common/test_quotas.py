"""Quotas: in-flight counts per tenant and session, KV block claims, tokens per minute."""

from __future__ import annotations

import pytest

from splitserve.common.quotas import WINDOW_S, QuotaExceeded, Quotas
from splitserve.common.tenants import Limits, Tenant


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def over(quotas: Quotas, tenant: Tenant, session=None, blocks=0) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as e:
        quotas.admit(tenant, session, blocks)
    return e.value


def test_in_flight_limits_per_tenant_and_per_session():
    q = Quotas()
    t = Tenant("a", Limits(requests_in_flight=3, session_requests_in_flight=2))
    s1 = [q.admit(t, "s1"), q.admit(t, "s1")]
    assert over(q, t, "s1").limit == "session_requests_in_flight"
    other = q.admit(t, "s2")  # another session of the tenant still gets in
    assert over(q, t, "s3").limit == "requests_in_flight"
    assert over(q, t, None).retry_after_s == 1
    s1[0].release()
    s1[0].release()  # idempotent
    assert q.in_flight("a") == 2
    q.admit(t, "s1")
    other.release()
    q.admit(t, None)
    assert q.admit(Tenant("b"), "s1") is not None  # other tenants are not counted against a


def test_kv_block_claims():
    q = Quotas()
    t = Tenant("a", Limits(kv_blocks=10))
    first = q.admit(t, None, blocks=6)
    e = over(q, t, None, blocks=5)
    assert e.limit == "kv_blocks" and "6 of its 10" in str(e)
    q.admit(t, None, blocks=4)
    first.release()
    q.admit(t, None, blocks=6)


def test_tokens_per_minute_over_a_sliding_window():
    clock = Clock()
    q = Quotas(clock)
    t = Tenant("a", Limits(tokens_per_minute=100))
    q.admit(t, None).release(tokens=60)
    clock.t += 20
    q.admit(t, None).release(tokens=50)  # admitted under the limit; now 110 in the window
    e = over(q, t)
    assert e.limit == "tokens_per_minute" and e.retry_after_s == 40  # when the 60 age out
    clock.t += 40
    q.admit(t, None).release(tokens=10)
    clock.t += WINDOW_S
    q.admit(t, None)
