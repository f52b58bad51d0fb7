"""One process's address space: the ``ProcessTable.space_for`` view of its executable mappings.

Invariants:
- A space's mapping list is immutable once built (``SpaceState``): a change replaces the state, so
  spaces share one after FORK (copy-on-write) and a state handle taken earlier still describes
  the space as it was then (the engine unwinds a sample against the state of its time).
- Only the owning ``ProcessTable`` mutates a space (the ``_set``/``_hold``/``_unhold`` methods):
  mappings come and go through it, in record order.
- ``generation`` changes whenever the mapping list changes, and only then (one process-wide
  counter, so generations only grow).
- References: a space counts its mappings per distinct binary (ELF cache entry); ``_hold``
  says when the first one arrives, ``_unhold`` when the last one goes, so the table takes and
  releases exactly one resolver reference per binary per space.
- Cost: ``find`` is one bisect, O(log n); ``modules()``/``native_space()`` are rebuilt only
  when the mapping list changed since the last call, cached on the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..binaries.elfentry import ElfEntry
from .mapping import Mapping, find_mapping

__all__ = ["AddressSpace", "SpaceOwner", "SpaceState", "is_jit_code", "is_jit_name"]


class SpaceOwner(Protocol):
    """What a space asks of its table (``ProcessTable``): the unwinder's factories and the
    module key of a mapping."""

    def code_key(self, entry: ElfEntry, m: Mapping) -> int: ...

    def module_factory(self) -> Callable[..., Any]: ...

    def space_factory(self) -> Callable[..., Any]: ...


class SpaceState:
    """Immutable once built: the mapping list of one or more spaces (shared after FORK),
    plus the lazily built modules / native space of exactly this list."""

    __slots__ = ("generation", "mappings", "modules", "native", "starts")

    def __init__(self, mappings: tuple[Mapping, ...], generation: int,
                 starts: list[int] | None = None) -> None:  # fmt: skip
        self.mappings = mappings
        self.starts = [m.start for m in mappings] if starts is None else starts
        self.generation = generation
        self.modules: list[Any] | None = None
        self.native: object | None = None


def is_jit_name(name: str) -> bool:
    """Whether an executable mapping of this name is a JIT's code: memory without a file
    (perf's "//anon" MMAP name, an empty or "[anon:...]" name in /proc/<pid>/maps), or a memfd
    (what double-mapping JITs execute from). A JIT names its code in /tmp/perf-<pid>.map; the
    unwinder walks it by frame pointer (V8 and HotSpot keep rbp chains in compiled code).
    Not "[vdso]", "[vsyscall]", "[stack]" and the like: the kernel's, or not code at all."""
    return name == "" or name.startswith(("//anon", "[anon:", "/memfd:"))


def is_jit_code(m: Mapping) -> bool:
    """``is_jit_name`` of a mapping without a usable binary."""
    return (m.entry is None or not m.entry.usable) and is_jit_name(m.filename)


_EMPTY = SpaceState((), 0)
_generations = iter(range(1, 1 << 62))


class AddressSpace:
    """One process's executable mappings (the ``space_for`` view)."""

    def __init__(self, pid: int, table: SpaceOwner) -> None:
        self.pid = pid
        self._table = table
        self._state = _EMPTY
        self._refs: dict[int, int] = {}  # entry uid -> mappings of it here (> 0)
        self._entries: dict[int, ElfEntry] = {}
        self.retired = False
        self.retired_at: int | None = None
        self.from_proc_maps = False
        self.start_time: int | None = None  # /proc/<pid>/stat starttime (ticks since boot)
        self.start_exact = False  # read from /proc (else estimated from a FORK record's time)
        self.verified_epoch = 0  # the table epoch this space was last known to be current in
        self.last_used = 0  # record time of the last sample placed in it (cap eviction order)

    def __repr__(self) -> str:
        state = " retired" if self.retired else ""
        return f"AddressSpace(pid={self.pid}, {len(self._state.mappings)} mappings{state})"

    @property
    def mappings(self) -> tuple[Mapping, ...]:
        return self._state.mappings

    @property
    def generation(self) -> int:
        """Changes whenever the mapping list changes (and only then)."""
        return self._state.generation

    def __len__(self) -> int:
        return len(self._state.mappings)

    def find(self, addr: int) -> Mapping | None:
        st = self._state
        return find_mapping(st.starts, st.mappings, addr)

    def entries(self) -> list[ElfEntry]:
        """Distinct binaries this space holds a reference to."""
        return list(self._entries.values())

    @property
    def state(self) -> object:
        """An opaque handle on the current mapping list (immutable): ``modules`` and
        ``native_space`` take it to build what the space was then, after later changes."""
        return self._state

    def modules(self, factory: Callable[..., Any] | None = None,
                state: object | None = None) -> list[Any]:  # fmt: skip
        """Unwinder modules ``factory(start, end, bias, table, key[, jit])``
        (``unwinder.Module``), one per mapping with a usable binary, and one without a table
        (``jit``: frame pointers only) per mapping of JIT code (``is_jit_code``); cached until
        the mapping list changes."""
        st = self._state if state is None else state
        assert isinstance(st, SpaceState)
        if st.modules is None:
            make = factory or self._table.module_factory()
            code_key = self._table.code_key
            mods = []
            for m in st.mappings:
                e = m.entry
                if e is None or not e.usable:  # (is_jit_code, inlined: once per mapping of
                    if is_jit_name(m.filename):  # every new space)
                        mods.append(make(m.start, m.end, 0, None, 0, True))
                    continue
                mods.append(make(m.start, m.end, m.bias, e.cfi(), code_key(e, m)))
            st.modules = mods
        return st.modules

    def native_space(self, state: object | None = None) -> object:
        """The native ``AddressSpace(modules)``, rebuilt only after a mapping change (of the
        current mapping list, or of ``state``, a ``state`` handle taken earlier)."""
        st = self._state if state is None else state
        assert isinstance(st, SpaceState)
        if st.native is None:
            cls = self._table.space_factory()
            st.native = cls(self.modules(state=st))
        return st.native

    # -- mutation (ProcessTable only)

    def _set(self, mappings: tuple[Mapping, ...], starts: list[int] | None = None) -> None:
        self._state = SpaceState(mappings, next(_generations), starts)

    def _hold(self, entry: ElfEntry | None) -> bool:
        """Count one more mapping of ``entry``; True if it is the first one here."""
        if entry is None:
            return True
        uid = entry.uid
        n = self._refs.get(uid, 0)
        if not n:
            self._entries[uid] = entry
        self._refs[uid] = n + 1
        return not n

    def _unhold(self, entry: ElfEntry | None) -> ElfEntry | None:
        """Drop one mapping's hold; the entry if this space no longer maps it."""
        if entry is None:
            return None
        uid = entry.uid
        n = self._refs.get(uid, 0) - 1
        if n <= 0:
            self._refs.pop(uid, None)
            return self._entries.pop(uid)
        self._refs[uid] = n
        return None
