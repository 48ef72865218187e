"""A short schemathesis run against a real worker and a real router (``make fuzz`` runs the
long one): no 5xx, no hang, answers as the schema says, and the worker unchanged after."""

from __future__ import annotations

import pytest
from fuzzing import campaign

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CASES = 80  # per server (make fuzz runs 2,000+)


def test_generated_requests_get_no_5xx_and_no_hang(fuzz_stack):
    worker, router, problems = campaign(fuzz_stack, CASES)
    for tally in (worker, router):
        assert tally.cases >= CASES, tally.summary()
        assert tally.server_errors == 0 and tally.timeouts == 0, tally.summary()
        assert tally.failures == [], "\n".join([tally.summary(), *tally.failures[:5]])
        assert tally.classes().get("2xx", 0) > 0, tally.summary()  # some requests got through
    assert problems == []
