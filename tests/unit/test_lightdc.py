"""lightdc builds the same classes as the standard ``dataclasses`` for the options unwindd uses:
each class here is defined twice from one body (once by each decorator) and the two are held
to the same behaviour: construction (positional, keyword, defaults, factories, errors),
equality and hashing, repr, frozen assignment, ``__post_init__``, ``__match_args__``,
pickling, and the ``dataclasses`` functions (``fields``, ``asdict``, ``replace``) on them.
And the package's own classes are lightdc's: none of them pays for the standard decorator."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import pickle
import pkgutil
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import unwindd
from unwindd import lightdc

# One body per case: (decorator options, class body), the body written against ``dc``/``fld``.
CASES: dict[str, tuple[dict[str, bool], str]] = {
    "frozen_slots": ({"frozen": True, "slots": True}, """
class C:
    '''doc'''
    a: int
    b: str | None
    c: float = 1.5
    d: tuple[int, ...] = fld(default_factory=tuple)
    e: Any = fld(default=None, compare=False, repr=False)
    k: ClassVar[int] = 7
"""),
    "mutable": ({}, """
class C:
    '''doc'''
    n: int = 0
    items: list[int] = fld(default_factory=list)
    tag: str = "x"
"""),
    "mutable_slots": ({"slots": True}, """
class C:
    '''doc'''
    n: int
    m: dict[str, int] = fld(default_factory=dict)
"""),
    "one_field": ({"frozen": True, "slots": True}, """
class C:
    '''doc'''
    x: float
"""),
    "no_fields": ({"frozen": True}, """
class C:
    '''doc'''
"""),
    "init_false": ({"frozen": True, "slots": True}, """
class C:
    '''doc'''
    a: int
    cached: int | None = fld(default=None, init=False, repr=False, compare=False)
    made: list[int] = fld(default_factory=list, init=False)
"""),
    "post_init": ({"frozen": True, "slots": True}, """
class C:
    '''doc'''
    a: int
    twice: int = fld(default=0, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "twice", 2 * self.a)
"""),
    "own_methods": ({"frozen": True, "slots": True}, """
class C:
    '''doc'''
    a: int
    b: int = 0

    def __hash__(self) -> int:
        return 42

    def __repr__(self) -> str:
        return "mine"
"""),
    "own_eq_unhashable": ({}, """
class C:
    '''doc'''
    a: int

    def __eq__(self, other: object) -> bool:
        return True
"""),
}


def _pair(case: str) -> tuple[Any, Any]:
    opts, body = CASES[case]
    out = []
    for dc, fld in ((dataclasses.dataclass, dataclasses.field),
                    (lightdc._dataclass, lightdc._field)):  # fmt: skip
        ns: dict[str, Any] = {"fld": fld, "Any": Any, "ClassVar": ClassVar,
                              "__name__": __name__}  # fmt: skip
        exec(body, ns)
        out.append(dc(**opts)(ns["C"]))
    return out[0], out[1]


def _outcome(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kw)
    except Exception as e:
        kind = "AttributeError" if isinstance(e, AttributeError) else type(e).__name__
        return kind, None


ARGS: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "frozen_slots": [((1, "s"), {}), ((1, None, 2.0, (3,), "e"), {}), ((), {"a": 1, "b": "z"}),
                     ((1,), {}), ((1, "s", 1.5, (), None, 9), {}), ((1, "s"), {"zz": 1}),
                     ((1, "s"), {"a": 2})],
    "mutable": [((), {}), ((5, [1, 2]), {}), ((), {"tag": "y"})],
    "mutable_slots": [((1,), {}), ((1, {"a": 1}), {})],
    "one_field": [((1.0,), {}), ((math.nan,), {})],
    "no_fields": [((), {}), ((1,), {})],
    "init_false": [((1,), {}), ((1, 2), {}), ((), {"cached": 3, "a": 1})],
    "post_init": [((3,), {}), ((3, 9), {})],
    "own_methods": [((1,), {}), ((1, 2), {})],
    "own_eq_unhashable": [((1,), {})],
}  # fmt: skip


def _state(o: Any, std: type) -> dict[str, Any]:
    return {f.name: getattr(o, f.name) for f in dataclasses.fields(std)}


def _compared_alike(made: list[tuple[Any, Any]], std: type, case: str) -> None:
    """Pairs (standard instance, lightdc instance) from the same arguments: the same repr,
    equality, hash and frozen behaviour, field by field."""
    frozen = CASES[case][0].get("frozen", False)
    for s1, l1 in made:
        assert repr(l1) == repr(s1)
        for s2, l2 in made:
            assert (l1 == l2) == (s1 == s2)
            assert (l1 != l2) == (s1 != s2)
        if "__eq__" not in vars(std):
            assert (l1 == s1) is False  # another class: NotImplemented both ways
        if std.__hash__ is not None:
            a, b = _outcome(hash, s1), _outcome(hash, l1)
            assert a[0] == b[0]
            if a[0] == "ok":
                assert (b[1] == hash(made[0][1])) == (a[1] == hash(made[0][0]))
        if not frozen:
            continue
        for name in [f.name for f in dataclasses.fields(std)]:
            for op, extra in ((setattr, (0,)), (delattr, ())):
                a, b = _outcome(op, s1, name, *extra), _outcome(op, l1, name, *extra)
                assert a[0] == b[0] == "AttributeError", (name, a, b)
                with pytest.raises(lightdc.FrozenInstanceError):
                    op(l1, name, *extra)
        # (the standard one raises TypeError for a name that is not a field of a slots
        # class: its __setattr__ names the class it replaced; AttributeError here)
        with pytest.raises(AttributeError):
            l1.other = 0  # type: ignore[attr-defined]
        assert _state(l1, std) == _state(s1, std)


STUBBED = ("__init__", "__eq__", "__hash__")


@pytest.mark.parametrize("tier", ["generic", "compiled"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_behaviour_as_dataclasses(case: str, tier: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways lightdc serves a class: its first calls by the stubs' generic closures
    ("generic": the class never gets hot), and by the compiled methods ("compiled": hot from
    its first call)."""
    monkeypatch.setattr(lightdc, "HOT", 10**9 if tier == "generic" else 1)
    std, light = _pair(case)
    assert light.__name__ == std.__name__ and light.__qualname__ == std.__qualname__
    assert light.__match_args__ == std.__match_args__
    assert hasattr(light, "__slots__") == hasattr(std, "__slots__")
    if hasattr(std, "__slots__"):
        assert light.__slots__ == std.__slots__
    assert (light.__hash__ is None) == (std.__hash__ is None)
    stubs = {n: light.__dict__.get(n) for n in STUBBED if f"def {n}" not in CASES[case][1]}
    calls = [(args, kw, _outcome(std, *args, **kw)) for args, kw in ARGS[case]]
    made = []
    for args, kw, a in calls:
        if a[0] == "ok":
            b = _outcome(light, *args, **kw)
            assert b[0] == "ok", (args, kw, b)
            made.append((a[1], b[1]))
    assert made
    _compared_alike(made, std, case)
    now = {n: light.__dict__.get(n) for n in stubs}
    if tier == "generic":  # everything above was served without compiling
        assert now == stubs
    else:  # compiled at the first call, in place of the stubs
        for name, fn in now.items():
            if fn is not None:
                assert fn.__code__.co_filename.startswith("<lightdc "), name
    # a call that does not bind, each the first call of its class: the interpreter's
    # TypeError, from the compiled __init__
    for args, kw, a in calls:
        if a[0] != "ok":
            fresh = _pair(case)[1]
            assert _outcome(fresh, *args, **kw)[0] == a[0], (args, kw)
            if "__init__" in stubs:
                assert fresh.__dict__["__init__"].__code__.co_filename.startswith("<lightdc ")
    monkeypatch.setattr(lightdc, "HOT", 1)
    light(*ARGS[case][0][0], **ARGS[case][0][1])  # (hot now: the compiled signature)
    assert str(inspect.signature(light.__init__)) == str(inspect.signature(std.__init__))


def test_a_class_is_compiled_once_hot() -> None:
    """The ``HOT``-th call of a class's ``__init__``, ``__eq__`` or ``__hash__`` (counted
    together) compiles them; instances made before and after are alike."""
    std, light = _pair("frozen_slots")
    stub = light.__dict__["__init__"]
    early = [light(i, "s") for i in range(lightdc.HOT - 1)]
    assert light.__dict__["__init__"] is stub
    late = light(0, "s")
    assert light.__dict__["__init__"] is not stub
    assert light.__dict__["__hash__"].__code__.co_filename.startswith("<lightdc ")
    assert late == early[0] and hash(late) == hash(early[0]) and late != early[1]
    assert repr(late) == repr(std(0, "s")).replace(std.__qualname__, light.__qualname__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dataclasses_functions_work(case: str) -> None:
    std, light = _pair(case)
    args, kw = ARGS[case][0]
    s, o = std(*args, **kw), light(*args, **kw)
    assert dataclasses.is_dataclass(o) and dataclasses.is_dataclass(light)
    assert [(f.name, f.type, f.init, f.repr, f.compare) for f in dataclasses.fields(o)] == \
        [(f.name, f.type, f.init, f.repr, f.compare) for f in dataclasses.fields(s)]
    assert lightdc.field_names(light) == tuple(f.name for f in dataclasses.fields(std))
    assert dataclasses.asdict(o) == dataclasses.asdict(s)
    assert dataclasses.replace(o) == o and lightdc.replace(o) == o
    for f in dataclasses.fields(std):
        if f.init:
            with_std = _outcome(dataclasses.replace, s, **{f.name: 5})
            with_light = _outcome(lightdc.replace, o, **{f.name: 5})
            assert with_std[0] == with_light[0]
            if with_std[0] == "ok":
                assert _state(with_light[1], std) == _state(with_std[1], std)
        else:
            with pytest.raises(ValueError):
                lightdc.replace(o, **{f.name: 5})


def test_pickles_like_dataclasses() -> None:
    std, light = _pair("frozen_slots")
    std.__qualname__ = light.__qualname__ = "C"
    for cls in (std, light):
        globals()["C"] = cls  # (pickle finds a class by module and qualified name)
        try:
            o = cls(1, "s", 2.5, (4,), "e")
            back = pickle.loads(pickle.dumps(o))
            assert back == o and back.e == "e"
        finally:
            del globals()["C"]


def test_refuses_what_it_does_not_build() -> None:
    std, _ = _pair("mutable")
    with pytest.raises(TypeError):
        lightdc._dataclass(type("D", (std,), {"__annotations__": {"x": "int"}}))
    with pytest.raises(TypeError):
        lightdc._dataclass(type("E", (), {"__annotations__": {"x": "InitVar[int]"}}))
    for mutable in ([], {}, set(), bytearray()):  # (refused by both; a tuple is not)
        body = {"__annotations__": {"x": "Any"}, "x": mutable}
        with pytest.raises(ValueError):
            dataclasses.dataclass(type("F", (), dict(body)))
        with pytest.raises(ValueError):
            lightdc._dataclass(type("F", (), dict(body)))
    lightdc._dataclass(type("F", (), {"__annotations__": {"x": "Any"}, "x": ()}))
    with pytest.raises(TypeError):
        lightdc._dataclass(type("G", (), {"__annotations__": {"x": "int", "y": "int"},
                                          "x": 1}))  # fmt: skip


def test_package_classes_are_lightdc() -> None:
    """Every dataclass in the package is built by lightdc."""
    std = []
    n = 0
    for info in pkgutil.walk_packages(unwindd.__path__, "unwindd."):
        if info.name in ("unwindd.cli",) or info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == mod.__name__ and \
                    "__dataclass_fields__" in obj.__dict__:
                n += 1
                if "_lightdc_fields" not in obj.__dict__:
                    std.append(f"{mod.__name__}.{obj.__qualname__}")
    assert n > 50
    assert std == []
