"""The ``__init__``s the compiled build writes out (``benchmarks/sim_compile.py``'s
``write_inits``; mypyc compiles a written ``__init__``, not the one ``@dataclass``
generates) must be what ``@dataclass`` would have generated: every field, its default.

Each module of ``NATIVE_INITS`` is rewritten as the build rewrites its copy and executed as
a module of its own; its classes are checked against their own dataclass fields."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import pytest

from tests.sim.test_compile import load_sim_compile

SC = load_sim_compile()
CLASSES = [(module, name) for module, names in SC.NATIVE_INITS.items() for name in names]


def rewritten(module: str) -> types.ModuleType:
    """``module`` (a path under ``src/``) as the compiled build writes it, imported anew."""
    name = "native_" + module.removesuffix(".py").replace("/", "_")
    if name not in sys.modules:
        path = SC.SRC / module
        source = SC.write_inits(path.read_text(), SC.NATIVE_INITS[module])
        mod = types.ModuleType(name)
        mod.__file__ = str(path)
        sys.modules[name] = mod  # dataclasses look the module up
        exec(compile(source, str(path), "exec"), mod.__dict__)
    return sys.modules[name]


def native(module: str, name: str) -> type:
    cls = getattr(rewritten(module), name)
    assert "__init__" in vars(cls) and inspect.isfunction(cls.__init__)
    return cls


def _default(f: dataclasses.Field[object]) -> object:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@pytest.mark.parametrize("module, name", CLASSES, ids=[n for _, n in CLASSES])
def test_a_written_init_takes_the_fields_in_order_with_their_defaults(module, name) -> None:
    cls = native(module, name)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert [p.name for p in params] == list(fields)
    required = [p for p in params if p.default is inspect.Parameter.empty]
    assert [p.name for p in required] == [
        n for n, f in fields.items() if _default(f) is dataclasses.MISSING
    ]
    args = [[] if p.name == "token_ids" else object() for p in required]  # len() taken
    obj = cls(*args)
    for p, value in zip(required, args, strict=True):
        assert getattr(obj, p.name) is value
    for field_name, f in fields.items():
        if field_name not in {p.name for p in required}:
            assert getattr(obj, field_name) == _default(f), field_name


def test_a_default_list_is_fresh_per_instance_and_post_init_runs() -> None:
    sequence = native("splitserve/engine/sequence.py", "Sequence")
    record = native("splitserve/workload/metrics.py", "RequestRecord")
    a = sequence("a", [1, 2], object(), b"r")
    b = sequence("b", [2, 3], object(), b"r", num_prompt_tokens=1)
    assert a.block_table is not b.block_table and a.block_hashes is not b.block_hashes
    assert a.num_prompt_tokens == 2 and b.num_prompt_tokens == 1  # ``__post_init__``'s
    assert record("s", 0, 0.0).itl_s is not record("s", 0, 0.0).itl_s


def _frozen_examples() -> list[tuple[object, str, object]]:
    """An instance of each frozen class, a field and another value of its type."""
    sessions = rewritten("splitserve/workload/sessions.py")
    info = native("splitserve/router/policies/base.py", "RequestInfo")
    seg = sessions.Segment("user", (1, 2))
    turn = sessions.TurnSpec(0.5, (seg,), 2, (3, 4))
    return [
        (seg, "token_ids", (5,)),
        (turn, "output_ids", (5, 6)),
        (sessions.SessionSpec("s", 0.0, 1, (turn,)), "session_id", "t"),
        (info("s", "p", 3), "session_key", "t"),
    ]


@pytest.mark.parametrize("example", _frozen_examples(), ids=lambda e: type(e[0]).__name__)
def test_frozen_classes_with_a_written_init_stay_frozen_and_hashable(example) -> None:
    obj, name, other = example
    twin = dataclasses.replace(obj)
    assert twin == obj and hash(twin) == hash(obj) and twin is not obj
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, other)
    changed = dataclasses.replace(obj, **{name: other})
    assert changed != obj and getattr(changed, name) == other


@pytest.mark.parametrize(
    "body, error",
    [
        ("    x: int = field(init=False)\n", "only field"),
        ("    x: list[int] | None = field(default_factory=list)\n", "may hold None"),
        ("    x: ClassVar[int] = 1\n", "not written out"),
        ("    x: int\n    def __init__(self) -> None:\n        self.x = 1\n", "of its own"),
    ],
)
def test_what_a_written_init_could_get_wrong_is_refused(body, error) -> None:
    source = f"@dataclass(slots=True)\nclass C:\n{body}"
    with pytest.raises(ValueError, match=error):
        SC.write_inits(source, ["C"])


def test_a_class_not_found_is_refused() -> None:
    with pytest.raises(ValueError, match="no class"):
        SC.write_inits("class D:\n    pass\n", ["C"])
