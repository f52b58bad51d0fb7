"""cffi (API mode) builder for ``unwindd._unwcore``: the CFI compiler, the unwinder, symbol
table scans, side-band filtering, file prefaulting, library calls, the CPython frame-chain
walk and the native pipeline context.

Same layout as ``build_perfcore.py`` (cryptography's ``src/_cffi_src/build_*.py``): the project's
own C files (``SOURCES``) are compiled as extra sources, and ``unwcore.h`` and ``fastpath.h``
are used twice, as the cdef (so the Python-visible interface cannot drift from the C one) and
as the headers the generated module includes. setup.py names this file as
``cffi_build/build_unwcore.py:ffibuilder``. Its importers are in ``daemon/unwindd/``:
binaries/ (cfi, demangle, elfcache, elfsyms, kallsyms), unwind/unwinder, pipeline/ (context,
filereplay, ringstep), procs/pywalk and source/mapfile.
"""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
HEADER = HERE / "unwcore.h"
FAST_HEADER = HERE / "fastpath.h"  # the native pipeline context (replay and live), same module
# the native pipeline context's stages (fastpath.h), each file one stage; the tests'
# nativebuild.py FASTPATH lists them too, for the sanitizer harnesses
FASTPATH = ["index.c", "order.c", "stacks.c", "parallel.c", "context.c", "live.c"]
# the CFI compiler (cfi_int.h): register model, pointer encodings, row storage, CFA
# interpreter, section reader, table builder, table lookup; nativebuild.py CFI lists them too
CFI = ["arch.c", "cfienc.c", "cfistore.c", "cfaprog.c", "ehframe.c", "cfitable.c", "cfilookup.c"]
SOURCES = [*(HERE / f for f in CFI), HERE / "unwind.c", *(HERE / f for f in FASTPATH),
           HERE / "symtab.c", HERE / "sideband.c", HERE / "mapfile.c", HERE / "fold.c",
           HERE / "libcall.c", HERE / "dwarfline.c", HERE / "pywalk.c", HERE / "crc32c.c",
           HERE / "stackenc.c"]

ffibuilder = FFI()
ffibuilder.cdef(HEADER.read_text() + FAST_HEADER.read_text())
ffibuilder.set_source(
    "unwindd._unwcore",
    # unwcore.h includes nothing (cffi's cdef parser rejects #include): supply the types first.
    '#include <stddef.h>\n#include <stdint.h>\n#include "unwcore.h"\n#include "fastpath.h"\n',
    # Relative to the build's cwd: distutils mirrors a source's path under build_temp for its
    # object file, and an absolute path would escape it.
    sources=[os.path.relpath(s) for s in SOURCES],
    include_dirs=[str(HERE)],
    # -pthread: parallel.c's unwind runs a worker thread (pthreads)
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11", "-pthread"],
    extra_link_args=["-pthread", "-ldl"],  # (-ldl: libcall.c's dlopen before glibc 2.34)
    depends=[str(HERE / h) for h in ("unwcore.h", "unwcore_int.h", "cfi_int.h", "dwread.h",
                                      "fastpath.h", "fastpath_int.h", "fastpath_util.h")],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
