"""The hot dataclasses' hand-written ``__init__`` (compiled by mypyc, unlike the generated
one) must stay what ``@dataclass`` would have generated: every field, its default."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.block_manager import PrefixMatch
from splitserve.engine.plan import ScheduledChunk, StepPlan, StepResult
from splitserve.engine.scheduler import SequenceUpdate
from splitserve.engine.sequence import Sequence
from splitserve.router.policies import RequestInfo
from splitserve.sim.cost_model import DecodeLine, StepShape
from splitserve.sim.engine import StepReport, _Run
from splitserve.sim.state import SimRequest
from splitserve.workload.metrics import RequestRecord
from splitserve.workload.sessions import Segment, SessionSpec, TurnSpec

HAND_WRITTEN = [
    PrefixMatch,
    SequenceUpdate,
    RequestRecord,
    ScheduledChunk,
    StepPlan,
    StepResult,
    Sequence,
    DecodeLine,
    StepShape,
    StepReport,
    _Run,
    SimRequest,
    Segment,
    TurnSpec,
    SessionSpec,
    RequestInfo,
]


def _default(f: dataclasses.Field[object]) -> object:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@pytest.mark.parametrize("cls", HAND_WRITTEN, ids=lambda c: c.__name__)
def test_hand_written_init_keeps_the_fields_and_their_defaults(cls: type) -> None:
    if not inspect.isfunction(cls.__init__):
        pytest.skip("compiled: the signature is not inspectable")
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = [p.name for p in params]
    assert names == [n for n in fields if n in names], "parameters out of field order"
    required = [p for p in params if p.default is inspect.Parameter.empty]
    assert [p.name for p in required] == [
        n for n, f in fields.items() if _default(f) is dataclasses.MISSING
    ]
    args = [[] if p.name == "token_ids" else object() for p in required]  # len() taken
    obj = cls(*args)
    for p, value in zip(required, args, strict=True):
        assert getattr(obj, p.name) is value
    for name, f in fields.items():
        if name not in {p.name for p in required}:
            assert getattr(obj, name) == _default(f), name


def test_a_default_list_is_fresh_per_instance() -> None:
    params = SamplingParams(max_tokens=1)
    a, b = Sequence("a", [1], params, b"r"), Sequence("b", [2], params, b"r")
    assert a.block_table is not b.block_table and a.block_hashes is not b.block_hashes
    assert a.num_prompt_tokens == 1
    assert RequestRecord("s", 0, 0.0).itl_s is not RequestRecord("s", 0, 0.0).itl_s


def _frozen_examples() -> list[tuple[object, str, object]]:
    """An instance of each frozen class, a field and another value of its type (compiled
    classes check their fields' types)."""
    seg = Segment("user", (1, 2))
    turn = TurnSpec(0.5, (seg,), 2, (3, 4))
    return [
        (seg, "token_ids", (5,)),
        (turn, "output_ids", (5, 6)),
        (SessionSpec("s", 0.0, 1, (turn,)), "session_id", "t"),
        (RequestInfo("s", "p", 3), "session_key", "t"),
    ]


@pytest.mark.parametrize("example", _frozen_examples(), ids=lambda e: type(e[0]).__name__)
def test_frozen_classes_with_a_hand_written_init_stay_frozen_and_hashable(example) -> None:
    obj, name, other = example
    twin = dataclasses.replace(obj)
    assert twin == obj and hash(twin) == hash(obj) and twin is not obj
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, other)
    changed = dataclasses.replace(obj, **{name: other})
    assert changed != obj and getattr(changed, name) == other
