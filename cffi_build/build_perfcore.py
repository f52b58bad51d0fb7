"""cffi (API mode) builder for ``unwindd._perfcore``.

Layout follows cryptography's ``src/_cffi_src/build_*.py``: the project's own ``perfcore.c`` and
``ringspill.c`` are compiled as extra sources, and ``perfcore.h`` is used twice, as the cdef (so
the Python-visible interface cannot drift from the C one) and as the header the generated module
includes.
setup.py names this file as ``cffi_build/build_perfcore.py:ffibuilder``.
"""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
HEADER = HERE / "perfcore.h"
SOURCES = [HERE / "perfcore.c", HERE / "ringspill.c"]

ffibuilder = FFI()
ffibuilder.cdef(HEADER.read_text())
ffibuilder.set_source(
    "unwindd._perfcore",
    # perfcore.h deliberately includes nothing (cffi's cdef parser rejects #include); the
    # generated module supplies the standard types first.
    '#include <stddef.h>\n#include <stdint.h>\n#include "perfcore.h"\n',
    # Relative to the build's cwd: distutils mirrors a source's path under build_temp for its
    # object file, and an absolute path would escape it.
    sources=[os.path.relpath(s) for s in SOURCES],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11", "-pthread"],
    extra_link_args=["-pthread"],  # the spill's thread (ringspill.c)
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
