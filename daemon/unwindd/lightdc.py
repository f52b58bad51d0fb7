"""``dataclass``, ``field`` and ``replace``: the standard library's for the type checker, and at
run time a builder of the same classes for the subset of ``dataclasses`` unwindd uses.

Why: ``dataclasses.dataclass`` compiles each generated method separately (``__init__``,
``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``, ``__getstate__``,
``__setstate__``: one ``exec`` each) and imports ``inspect`` (with ``ast``, ``dis``,
``tokenize``): a short command such as ``unwindd replay`` paid for it at every start, for some
fifty classes on its import path. Here ``__init__``, ``__eq__`` and ``__hash__`` are compiled
(their speed matters: records and frames are built, compared and hashed by the thousand), in
one ``compile``, and only once a class is hot: its first ``HOT`` calls of them are served by
generic closures doing the same work, and then stubs compile them and put them in their
places. The other methods are shared closures.

Invariants (what the classes keep of ``dataclasses``' behaviour, Python 3.11):
- The options used: ``frozen``, ``slots``; ``field(default=, default_factory=, init=, repr=,
  compare=, metadata=)``; ``__post_init__``; a ``ClassVar`` annotation is not a field. Anything
  else (inheritance from a dataclass, ``InitVar``, ``KW_ONLY``, ``order``) is refused at
  import, so a class never silently differs from what the standard decorator would build.
- ``__init__`` is the same code the standard decorator generates (before that, the generic one
  sets the same fields to the same values in the same order; a call that does not bind is
  handed to the compiled code, for the interpreter's own TypeError); ``__eq__`` compares the
  tuples of the compared fields of two instances of the same class (NotImplemented otherwise);
  frozen classes hash that tuple, other classes are unhashable (unless they define
  ``__hash__``); ``__repr__`` is ``Name(f=value, ...)``; a frozen instance refuses assignment
  and deletion (``FrozenInstanceError``, an ``AttributeError``); a method the class defines
  itself is kept; ``__match_args__``, and pickling of frozen slots classes, as there.
- ``__dataclass_fields__`` is built on first use (importing ``dataclasses`` then), so
  ``dataclasses.fields``, ``asdict``, ``replace`` and ``is_dataclass`` work on these classes.
  ``field_names`` and ``replace`` here answer without it.
- Not kept: the docstring ``dataclasses`` makes up (from ``inspect.signature``) for a class
  without one.

Cost: at definition no ``compile``, a few closures; one ``compile`` (what dozens of generic
calls cost) at a class's ``HOT``-th instantiation, comparison or hash, or at a call that does
not bind; together about a seventh of the standard decorator's time. A generic call costs a
few times a compiled one; hot instances cost the same to build, compare and hash (the same
code); ``repr`` is slower.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar, cast

__all__ = ["FrozenInstanceError", "dataclass", "field", "field_names", "replace"]

_T = TypeVar("_T")

# Calls of a class's __init__, __eq__ and __hash__ (together) after which they are compiled.
HOT = 16


class FrozenInstanceError(AttributeError):
    """Assignment to (or deletion of) a field of a frozen instance."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


class _HasDefaultFactory:
    def __repr__(self) -> str:
        return "<factory>"


_HAS_DEFAULT_FACTORY = _HasDefaultFactory()


class _Field:
    """What ``field(...)`` returns in a class body; replaced by the class's field list."""

    __slots__ = (
        "compare",
        "default",
        "default_factory",
        "init",
        "metadata",
        "name",
        "repr",
        "type",
    )  # fmt: skip

    def __init__(self, default: Any, default_factory: Any, init: bool, repr: bool,
                 compare: bool, metadata: Any) -> None:  # fmt: skip
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.name = ""
        self.type: Any = None
        self.default = default
        self.default_factory = default_factory
        self.init = init
        self.repr = repr
        self.compare = compare
        self.metadata = metadata


def _field(*, default: Any = MISSING, default_factory: Any = MISSING, init: bool = True,
           repr: bool = True, compare: bool = True, metadata: Any = None) -> Any:  # fmt: skip
    return _Field(default, default_factory, init, repr, compare, metadata)


def _is_classvar(annotation: Any) -> bool:
    # ``from __future__ import annotations``: annotations are strings; dataclasses matches
    # the name the same way (dataclasses._is_type, for ``ClassVar`` and ``typing.ClassVar``)
    s = annotation if isinstance(annotation, str) else getattr(annotation, "__qualname__", "")
    head = s.split("[", 1)[0].strip()
    return head in ("ClassVar", "typing.ClassVar")


def _fields_of(cls: type) -> list[_Field]:
    for base in cls.__mro__[1:]:
        if "__dataclass_fields__" in base.__dict__ or "_lightdc_fields" in base.__dict__:
            raise TypeError(f"{cls.__name__}: inheriting fields is not supported (lightdc)")
    out = []
    # the class body's own annotations (inspect.get_annotations would import inspect)
    for name, ann in cls.__dict__.get("__annotations__", {}).items():  # noqa: RUF063
        if _is_classvar(ann):
            continue
        head = ann.split("[", 1)[0].strip() if isinstance(ann, str) else ""
        if head in ("InitVar", "dataclasses.InitVar", "KW_ONLY", "dataclasses.KW_ONLY"):
            raise TypeError(f"{cls.__name__}.{name}: {head} is not supported (lightdc)")
        value = cls.__dict__.get(name, MISSING)
        f = value if isinstance(value, _Field) else _field(default=value)
        if f.default is not MISSING and f.default.__class__.__hash__ is None:
            # dataclasses' rule for mutable defaults (3.11: an unhashable one's class)
            raise ValueError(f"mutable default {type(f.default)} for field {name} is not "
                             "allowed: use default_factory")  # fmt: skip
        f.name, f.type = name, ann
        out.append(f)
    seen_default = False  # (checked here: __init__ is compiled later, on first use)
    for f in out:
        if not f.init:
            continue
        if f.default is MISSING and f.default_factory is MISSING:
            if seen_default:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
        else:
            seen_default = True
    return out


def _compiled(cls: type, flds: list[_Field], frozen: bool, slots: bool,
              names: tuple[str, ...]) -> dict[str, Any]:
    """``__init__``, ``__eq__`` and ``__hash__`` (those of ``names``) as dataclasses writes them
    (3.11: _init_fn, _cmp_fn, _hash_fn), compiled together, once."""
    ns: dict[str, Any] = {"_HAS_DEFAULT_FACTORY": _HAS_DEFAULT_FACTORY,
                          "__dataclass_builtins_object__": object}  # fmt: skip
    params, body = [], []
    for f in flds:
        dflt = f"_dflt_{f.name}"
        if f.init:
            if f.default is MISSING and f.default_factory is MISSING:
                params.append(f.name)
            else:
                params.append(f"{f.name}=_HAS_DEFAULT_FACTORY"
                              if f.default_factory is not MISSING else f"{f.name}={dflt}")
        if f.default_factory is not MISSING:
            ns[dflt] = f.default_factory
            value = (f"{dflt}() if {f.name} is _HAS_DEFAULT_FACTORY else {f.name}" if f.init
                     else f"{dflt}()")  # fmt: skip
        elif f.init:
            if f.default is not MISSING:
                ns[dflt] = f.default
            value = f.name
        elif slots and f.default is not MISSING:
            ns[dflt] = f.default
            value = dflt
        else:
            continue  # read through the class attribute holding the default
        body.append(f"__dataclass_builtins_object__.__setattr__(self, {f.name!r}, {value})"
                    if frozen else f"self.{f.name} = {value}")  # fmt: skip
    if "__post_init__" in cls.__dict__:
        body.append("self.__post_init__()")
    src = [f"def __init__(self, {', '.join(params)}):", *(body or ["pass"])]
    # attribute loads the interpreter specializes (slots): faster than an attrgetter
    compared = [f.name for f in flds if f.compare]
    mine = "".join(f"self.{n}," for n in compared)
    theirs = "".join(f"other.{n}," for n in compared)
    if "__eq__" in names:
        src += ["def __eq__(self, other):", " if other.__class__ is self.__class__:",
                f"  return ({mine})==({theirs})", " return NotImplemented"]  # fmt: skip
    if "__hash__" in names:
        src += ["def __hash__(self):", f" return hash(({mine}))"]
    text = "\n".join(line if line.startswith("def ") else " " + line for line in src) + "\n"
    exec(compile(text, f"<lightdc {cls.__qualname__}>", "exec"), ns)
    out = {name: ns[name] for name in ("__init__", *names)}
    for name, fn in out.items():
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
    out["__init__"].__annotations__ = {**{f.name: f.type for f in flds if f.init},
                                       "return": None}  # fmt: skip
    return out


def _generic_init(cls: type, flds: list[_Field], frozen: bool,
                  slots: bool) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], bool]:
    """``__init__``'s work without its compiled code, for the calls before a class is hot:
    binds ``args`` and ``kwargs`` to the init fields and sets every field ``_compiled``'s
    ``__init__`` sets, with the same values in the same order, then ``__post_init__``. Returns
    False, having done nothing, for a call that does not bind (too many arguments, an unknown
    or repeated keyword, a required field missing): the compiled ``__init__`` raises the
    interpreter's own TypeError for it."""
    params = [f.name for f in flds if f.init]
    known = frozenset(params)
    required = [f.name for f in flds
                if f.init and f.default is MISSING and f.default_factory is MISSING]  # fmt: skip
    # (name, its argument's name or None, the default or MISSING, the factory or MISSING),
    # for each field __init__ sets, in field order
    plan = [(f.name, f.name if f.init else None, f.default, f.default_factory) for f in flds
            if f.default_factory is not MISSING or f.init
            or (slots and f.default is not MISSING)]  # fmt: skip
    post_init = "__post_init__" in cls.__dict__
    put: Callable[[Any, str, Any], None] = object.__setattr__ if frozen else setattr

    def init(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if len(args) > len(params):
            return False
        bound = dict(zip(params, args, strict=False))
        for k in kwargs:
            if k in bound or k not in known:
                return False
        bound.update(kwargs)
        for name in required:
            if name not in bound:
                return False
        for name, arg, default, factory in plan:
            value = bound.get(arg, MISSING) if arg is not None else MISSING
            if value is MISSING:
                value = factory() if factory is not MISSING else default
            put(self, name, value)
        if post_init:
            self.__post_init__()
        return True

    return init


def _tuple_getter(names: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    if len(names) >= 2:
        return attrgetter(*names)
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda o: (one(o),)
    return lambda o: ()


def _process(cls: type, frozen: bool, slots: bool) -> type:
    flds = _fields_of(cls)
    names = [f.name for f in flds]
    own = cls.__dict__
    methods: dict[str, Any] = {}

    # __init__, __eq__ and __hash__ are compiled together once their calls reach HOT (the
    # stubs below put the compiled ones in their places); until then the stubs do the same
    # work generically. Most classes a short command imports are built, compared or hashed a
    # few times or never; a compile costs as much as dozens of generic calls.
    stubs: dict[str, Any] = {}
    calls = [0]
    generic_init = _generic_init(cls, flds, frozen, slots)
    compared = _tuple_getter([f.name for f in flds if f.compare])

    def compiled(name: str) -> Any:
        real = _compiled(cls, flds, frozen, slots, tuple(n for n in ("__eq__", "__hash__")
                                                         if n in stubs))  # fmt: skip
        for n, fn in real.items():
            if n in stubs and made.__dict__.get(n) is stubs[n]:
                type.__setattr__(made, n, fn)
        return real[name]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        # a call the generic binding refuses goes to the compiled code, for its TypeError
        if calls[0] >= HOT or not generic_init(self, args, kwargs):
            compiled("__init__")(self, *args, **kwargs)

    def __eq__(self: Any, other: Any) -> Any:
        calls[0] += 1
        if calls[0] >= HOT:
            return compiled("__eq__")(self, other)
        if other.__class__ is self.__class__:
            return compared(self) == compared(other)
        return NotImplemented

    def __hash__(self: Any) -> int:
        calls[0] += 1
        if calls[0] >= HOT:
            return cast(int, compiled("__hash__")(self))
        return hash(compared(self))

    shown = attrgetter(*[f.name for f in flds if f.repr] or ["__class__"])
    shown_names = [f.name for f in flds if f.repr]

    def __repr__(self: Any) -> str:
        if not shown_names:
            return f"{self.__class__.__qualname__}()"
        vals = shown(self) if len(shown_names) > 1 else (shown(self),)
        inner = ", ".join(f"{n}={v!r}" for n, v in zip(shown_names, vals, strict=True))
        return f"{self.__class__.__qualname__}({inner})"

    methods["__repr__"] = __repr__
    for name, stub in (("__init__", __init__), ("__eq__", __eq__)):
        if name not in own:
            methods[name] = stubs[name] = stub

    class_hash = own.get("__hash__", MISSING)
    explicit_hash = not (class_hash is MISSING or (class_hash is None and "__eq__" in own))
    if not explicit_hash:
        if frozen:
            methods["__hash__"] = stubs["__hash__"] = __hash__
        else:
            methods["__hash__"] = None

    frozen_cls: type = cls  # the class made below, once it is
    made: type = cls
    if frozen:
        field_set = frozenset(names)

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if type(self) is frozen_cls or name in field_set:
                raise FrozenInstanceError(f"cannot assign to field {name!r}")
            super(cast(Any, frozen_cls), self).__setattr__(name, value)

        def __delattr__(self: Any, name: str) -> None:
            if type(self) is frozen_cls or name in field_set:
                raise FrozenInstanceError(f"cannot delete field {name!r}")
            super(cast(Any, frozen_cls), self).__delattr__(name)

        methods["__setattr__"] = __setattr__
        methods["__delattr__"] = __delattr__
        if slots:
            get_all = _tuple_getter(names)

            def __getstate__(self: Any) -> list[Any]:
                return list(get_all(self))

            def __setstate__(self: Any, state: Any) -> None:
                for n, v in zip(names, state, strict=False):
                    object.__setattr__(self, n, v)

            methods["__getstate__"] = __getstate__
            methods["__setstate__"] = __setstate__

    methods["__match_args__"] = tuple(f.name for f in flds if f.init)

    d = dict(own)
    for name, m in methods.items():
        if name not in own or (name == "__hash__" and not explicit_hash):
            d[name] = m
    for f in flds:  # class attributes keep plain defaults, as dataclasses leaves them
        if isinstance(own.get(f.name), _Field):
            if f.default is MISSING:
                d.pop(f.name)
            else:
                d[f.name] = f.default
    d["_lightdc_fields"] = tuple(flds)
    d["__dataclass_fields__"] = _LazyFields()
    if slots:
        if "__slots__" in own:
            raise TypeError(f"{cls.__name__} already specifies __slots__")
        for n in names:
            d.pop(n, None)
        d.pop("__dict__", None)
        d.pop("__weakref__", None)
        d["__slots__"] = tuple(names)
    else:
        d.pop("__dict__", None)
        d.pop("__weakref__", None)
    new: type = type(cls)(cls.__name__, cls.__bases__, d)
    new.__qualname__ = cls.__qualname__
    frozen_cls = made = new  # (what the methods' closures refer to)
    return new


class _LazyFields:
    """``__dataclass_fields__``, made of ``dataclasses.Field`` objects on first access."""

    def __get__(self, obj: Any, owner: type) -> dict[str, Any]:
        import dataclasses

        make_field: Any = dataclasses.field  # (typeshed's overloads want literal defaults)
        out = {}
        for lf in owner.__dict__["_lightdc_fields"]:
            std = dataclasses.MISSING
            f = make_field(
                default=std if lf.default is MISSING else lf.default,
                default_factory=std if lf.default_factory is MISSING else lf.default_factory,
                init=lf.init, repr=lf.repr, compare=lf.compare, metadata=lf.metadata)
            f.name, f.type = lf.name, lf.type
            f._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
            f.kw_only = False
            out[lf.name] = f
        type.__setattr__(owner, "__dataclass_fields__", out)
        return out


def _dataclass(cls: Any = None, /, *, frozen: bool = False, slots: bool = False) -> Any:
    def wrap(c: type) -> type:
        return _process(c, frozen, slots)

    return wrap if cls is None else wrap(cls)


def field_names(cls: type) -> tuple[str, ...]:
    """The fields of a class built here, in order (``dataclasses.fields``' names)."""
    return tuple(f.name for f in cls.__dict__["_lightdc_fields"])


def _replace(obj: _T, /, **changes: Any) -> _T:
    """``dataclasses.replace`` for a class built here: a new instance through ``__init__``."""
    for f in type(obj).__dict__["_lightdc_fields"]:
        if not f.init:
            if f.name in changes:
                raise ValueError(f"field {f.name} is declared with init=False, it cannot be "
                                 "specified with replace()")  # fmt: skip
        elif f.name not in changes:
            changes[f.name] = getattr(obj, f.name)
    return obj.__class__(**changes)


if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
    from dataclasses import field as field
    from dataclasses import replace as replace
else:
    dataclass, field, replace = _dataclass, _field, _replace
