"""Symbol demangling the way ``perf script`` prints names (C++ Itanium, Rust legacy, Rust v0).

Rules (perf 6.1 as Debian builds it: no libbfd, GNU libiberty linked in statically, so
tools/perf/util/symbol-elf.c demangle_sym calls libiberty's ``cplus_demangle(name, flags)``):
- perf passes ``DMGL_NO_OPTS`` (0) unless ``-v``: no parameter list, no return type, no
  ``[clone .cold]`` suffix, Rust without the legacy hash or v0 crate disambiguators. With the
  default (auto) style, libiberty tries Rust first (``_R...`` v0, ``_ZN...17h<hash>E`` legacy),
  then the Itanium C++ ABI (``_Z``, ``_GLOBAL_[._$][ID]_``).
- The demangler is that same function: libiberty's ``cplus_demangle`` as exported by a shared
  library that links libiberty in, GNU binutils' libbfd (``libbfd-<version>*.so``, in every
  Debian/Ubuntu/Fedora binutils, which gcc depends on), opened with dlopen by the native module
  (cffi_build/libcall.c). Nothing is needed at build time; the output is libiberty's, not a
  reimplementation's.
- Without such a library (``engine()`` says which demangler runs) the fallback keeps C++ and
  Rust legacy right and prints v0 names raw: ``demangle_full`` is the c++filt form (libstdc++'s
  ``__cxa_demangle``, native or through ctypes) and ``strip_function_type`` removes the
  top-level function type from it (libiberty's d_encoding drops only that one, so enclosing
  functions of local names and thunk targets keep theirs); Rust legacy names are decoded by
  ``demangle_rust_legacy`` (perf's own rust-demangle.c, from rustc-demangle).
- A name that does not demangle is printed as is (perf too).

Cost: one demangler call per distinct symbol, cached by the caller (symbol tables store
demangled names once per binary); finding the library is one directory scan per process.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

__all__ = [
    "demangle",
    "demangle_full",
    "demangle_iberty",
    "demangle_rust_legacy",
    "engine",
    "strip_function_type",
]


class _Cxx:
    """libstdc++'s demangler, loaded on the first mangled name (loading it adds to a replay's
    start-up, and C-only profiles never need it)."""

    def __init__(self) -> None:
        self.fn: ctypes._NamedFuncPointer | None = None
        self.free: ctypes._NamedFuncPointer | None = None
        self.loaded = False

    def load(self) -> None:
        import ctypes  # not cheap to import: only when a mangled name shows up

        self.loaded = True
        try:
            # the soname first: find_library runs ldconfig/gcc, slower than the load itself
            lib = _cdll("libstdc++.so.6", "stdc++")
            libc = _cdll("libc.so.6", "c")
        except OSError:
            return
        fn = getattr(lib, "__cxa_demangle")  # a dunder name: attribute syntax would be mangled
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_int)]  # fmt: skip
        free = libc.free
        free.argtypes = [ctypes.c_void_p]
        free.restype = None
        self.fn, self.free = fn, free


def _cdll(soname: str, name: str) -> ctypes.CDLL:
    import ctypes

    try:
        return ctypes.CDLL(soname)
    except OSError:
        import ctypes.util  # (subprocess, shutil...: only when the soname fails)

        found = ctypes.util.find_library(name)
        if found is None:
            raise
        return ctypes.CDLL(found)


_cxx = _Cxx()


class _Native:
    """``__cxa_demangle`` through the native module (cffi_build/libcall.c): the same
    function as the ctypes path, without ctypes' import and per-call marshalling."""

    def __init__(self) -> None:
        self.cap = 4096
        self.buf: object = None

    def __call__(self, raw: bytes) -> tuple[bool, str | None]:
        """(True, the demangled name or None if it does not demangle); (False, None) when the
        native module finds no libstdc++."""
        from ..unwcore import ffi, lib

        while True:
            if self.buf is None:
                self.buf = ffi.new("char[]", self.cap)
            n = int(lib.unw_cxa_demangle(raw, self.buf, self.cap))
            if n >= 0:
                return True, bytes(ffi.buffer(self.buf, n)).decode("utf-8", "replace")
            if n == -1:
                return False, None
            if n == -2:
                return True, None
            self.cap, self.buf = -3 - n, None  # a longer name than any before: retry


_native = _Native()

# The prefixes libiberty's cplus_demangle can demangle in the auto style (rust_demangle: _R,
# _ZN; cplus_demangle_v3: _Z, _GLOBAL_): every other name comes back NULL, so it is not asked.
_IBERTY_PREFIXES = ("_Z", "_R", "_GLOBAL_")
DMGL_NO_OPTS = 0  # include/demangle.h: what perf passes unless -v


def _iberty_candidates() -> list[str]:
    """Shared libraries that export libiberty's cplus_demangle: binutils' libbfd
    (``libbfd-2.40-system.so`` on Debian, ``libbfd-2.41.so``-like elsewhere), newest version
    first, in the directories the dynamic linker searches by default."""
    import sys

    dirs = []
    # the build's multiarch triplet, what sysconfig's MULTIARCH says (sysconfig itself derives
    # its data module's name from it), without importing sysconfig and its data
    multiarch = getattr(sys.implementation, "_multiarch", None)
    if multiarch is None:
        import sysconfig

        multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs += [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"]
    dirs += ["/usr/lib64", "/lib64", "/usr/lib", "/lib"]
    found: list[tuple[list[int], str]] = []
    seen: set[str] = set()
    listed: set[str] = set()
    for d in dirs:
        real_dir = os.path.realpath(d)
        if real_dir in listed:  # merged /usr: /lib/<multiarch> is /usr/lib/<multiarch>
            continue
        listed.add(real_dir)
        try:
            names = os.listdir(d)  # (names only: a DirEntry per file costs more)
        except OSError:
            continue
        for name in names:
            if not name.startswith("libbfd") or ".so" not in name:
                continue
            path = os.path.join(d, name)
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            version = [int(x) for x in re.findall(r"\d+", name.split(".so")[0])]
            found.append((version, path))
    found.sort(key=lambda f: f[0], reverse=True)
    return [p for _, p in found]


class _Iberty:
    """libiberty's ``cplus_demangle`` through the native module (cffi_build/libcall.c)."""

    def __init__(self) -> None:
        self.state: bool | None = None  # None: not looked for yet
        self.path: str | None = None
        self.cap = 4096
        self.buf: object = None

    def available(self) -> bool:
        if self.state is None:
            from ..unwcore import lib

            self.state = False
            for path in _iberty_candidates():
                if int(lib.unw_iberty_open(path.encode("utf-8", "surrogateescape"))) == 0:
                    self.state, self.path = True, path
                    break
        return self.state

    def __call__(self, raw: bytes, options: int) -> str | None:
        from ..unwcore import ffi, lib

        while True:
            if self.buf is None:
                self.buf = ffi.new("char[]", self.cap)
            n = int(lib.unw_iberty_demangle(raw, options, self.buf, self.cap))
            if n >= 0:
                return bytes(ffi.buffer(self.buf, n)).decode("utf-8", "replace")
            if n in (-1, -2):
                return None
            self.cap, self.buf = -3 - n, None  # a longer name than any before: retry


_iberty = _Iberty()


def engine() -> str:
    """Which demangler ``demangle`` uses: ``libiberty (<library path>)`` or ``fallback``."""
    return f"libiberty ({_iberty.path})" if _iberty.available() else "fallback"


def demangle_iberty(name: str, options: int = DMGL_NO_OPTS) -> str | None:
    """libiberty's ``cplus_demangle(name, options)``, or None if it does not demangle ``name``
    or no library provides it."""
    if not _iberty.available():
        return None
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeError:
        return None
    return _iberty(raw, options)


@lru_cache(maxsize=4096)
def demangle_full(name: str) -> str | None:
    """The c++filt form of an Itanium-mangled name, or None if it does not demangle."""
    if not name.startswith("_Z"):
        return None
    try:
        found, got = _native(name.encode("utf-8", "surrogateescape"))
    except UnicodeError:
        return None
    if found:
        return got
    if not _cxx.loaded:
        _cxx.load()
    if _cxx.fn is None or _cxx.free is None:
        return None
    import ctypes  # loaded by _cxx.load: a dict lookup now

    status = ctypes.c_int(0)
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeError:
        return None
    ptr = _cxx.fn(raw, None, None, ctypes.byref(status))
    if not ptr:
        return None
    try:
        if status.value != 0:
            return None
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        _cxx.free(ptr)


_OPEN = {")": "(", ">": "<", "]": "[", "}": "{"}
_QUALS = (" const", " volatile", " &&", " &", " restrict", " noexcept", " transaction_safe")


def _match_back(s: str, end: int) -> int:
    """Index of the bracket opening the one at ``s[end]``, or -1."""
    close = s[end]
    opener = _OPEN[close]
    depth = 0
    for i in range(end, -1, -1):
        c = s[i]
        if c == close:
            depth += 1
        elif c == opener:
            depth -= 1
            if depth == 0:
                return i
    return -1


def strip_function_type(full: str) -> str:
    """``ret name<T>(params) const [clone .cold]`` -> ``name<T>`` (libiberty DMGL_NO_OPTS)."""
    s = full
    while s.endswith("]"):
        i = s.rfind(" [clone ")
        if i < 0:
            break
        s = s[:i]
    changed = True
    while changed:
        changed = False
        for q in _QUALS:
            if s.endswith(q):
                s = s[: -len(q)]
                changed = True
    if not s.endswith(")"):
        return s
    i = _match_back(s, len(s) - 1)
    if i <= 0:
        return s
    s = s[:i]
    # A return type is printed only for template functions ("void f<int>(int)"), i.e. when
    # the name ends with template args; it is separated from the name by a top-level space.
    # Brackets inside operator names ("operator>>", "operator()") are masked so that only
    # real brackets are counted.
    m = _OPERATOR.sub(lambda mo: "operator" + "_" * (len(mo[0]) - 8), s)
    if not m.endswith(">"):
        return s
    j = _match_back(m, len(m) - 1)
    if j <= 0:
        return s
    depth = 0
    for k in range(j - 1, -1, -1):
        c = m[k]
        if c in ")>]}":
            depth += 1
        elif c in "(<[{":
            depth = max(depth - 1, 0)
        elif c == " " and depth == 0 and not m[:k].endswith("operator"):
            if m[:k].rstrip("_").endswith("operator"):
                continue  # "operator<< <T>": the space libiberty puts after operator<
            return s[k + 1 :]
    return s


_OPERATOR = re.compile(r"operator(?:<<=|>>=|<=>|<<|>>|<=|>=|->\*|->|<|>|\(\)|\[\])")


_RUST_HASH = re.compile(r"17h[0-9a-f]{16}E$")
_RUST_ESCAPES = {
    "SP": "@", "BP": "*", "RF": "&", "LT": "<", "GT": ">", "LP": "(", "RP": ")", "C": ",",
}  # fmt: skip


def demangle_rust_legacy(name: str) -> str | None:
    """``_ZN4core3ptr13drop_in_place17h0123456789abcdefE`` -> ``core::ptr::drop_in_place``."""
    if not name.startswith("_ZN") or _RUST_HASH.search(name) is None:
        return None
    i = 3
    parts: list[str] = []
    end = len(name) - 1  # the final "E"
    while i < end:
        j = i
        while j < end and name[j].isdigit():
            j += 1
        if j == i:
            return None
        n = int(name[i:j])
        if n <= 0 or j + n > end:
            return None
        parts.append(name[j : j + n])
        i = j + n
    if i != end or len(parts) < 2:
        return None
    return "::".join(_rust_unescape(p) for p in parts[:-1])


def _rust_unescape(ident: str) -> str:
    if ident.startswith("_$"):
        ident = ident[1:]
    out: list[str] = []
    i = 0
    while i < len(ident):
        c = ident[i]
        if c == "$":
            j = ident.find("$", i + 1)
            if j < 0:
                out.append(ident[i:])
                break
            code = ident[i + 1 : j]
            if code in _RUST_ESCAPES:
                out.append(_RUST_ESCAPES[code])
            elif code.startswith("u") and len(code) > 1:
                try:
                    out.append(chr(int(code[1:], 16)))
                except ValueError:
                    out.append(ident[i : j + 1])
            else:
                out.append(ident[i : j + 1])
            i = j + 1
        elif ident.startswith("..", i):
            out.append("::")
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


# The symbol and line tables keep each name they demangled (per binary, see the module's Cost),
# so this only saves the second demangling of a name in another binary or a table loaded
# again: a few thousand recent names do that, where every distinct name of a long run would
# stay in memory for ever.
@lru_cache(maxsize=4096)
def demangle(name: str) -> str:
    """The name as ``perf script`` prints it (see the module rules)."""
    if not name.startswith(_IBERTY_PREFIXES):
        return name
    if _iberty.available():
        got = demangle_iberty(name)
        return name if got is None else got
    if not name.startswith("_Z"):
        return name
    rust = demangle_rust_legacy(name)
    if rust is not None:
        return rust
    full = demangle_full(name)
    if full is None and "@" in name:
        # libiberty without DMGL_PARAMS ignores trailing text such as a "@GLIBCXX_3.4"
        # version suffix in a .symtab name; __cxa_demangle rejects it, so cut it first.
        full = demangle_full(name[: name.index("@")])
    if full is None:
        return name
    if name[2:3] in ("T", "G"):  # special names: vtable/typeinfo/thunk/guard keep their text
        return full
    return strip_function_type(full)
