"""Reading perf.data, in file mode (seekable, sections) and pipe mode (a plain record stream).

The header-side bytes (file header, attrs, feature sections, build-ids) are parsed by
``perfheader``; this module reads the stream, frames records and decodes them with
``decoder.RecordDecoder``.

Invariants:
- Sans-IO apart from the stream the caller hands in (or the one ``PerfData.open`` opens for a
  path): no other files, no /proc, no clocks.
- Only a broken *main* header (bad magic, wrong header size, attrs section unreadable) raises,
  and it raises ``perfheader.PerfDataError`` with a message. Everything after that - a
  corrupt feature section, ids out of bounds, a truncated data section, a record whose size
  field is garbage - becomes a count in ``PerfData.errors`` (section level) or
  ``decoder.stats.errors`` (record level, the same keys ``RecordDecoder.decode`` uses:
  ``truncated``, ``bad_size``) and reading goes on with what is left. Any other exception
  escaping this module is a bug.
- Every record in the data section (file mode) or stream (pipe mode) becomes exactly one value
  from ``records()``, in stream order, including perf's own user records (HEADER_ATTR,
  HEADER_FEATURE, FINISHED_ROUND, ID_INDEX, ...) as ``records.Unknown``/``FinishedRound``.
- Termination: each step of the record loop consumes >= 8 bytes (a size field < 8 ends the
  stream, counted as ``bad_size``), so a read ends after at most ``data_size / 8`` records.
- Memory: the data section is streamed in chunks of ``CHUNK`` bytes; at most one chunk plus one
  record (a u16 size, so < 64 KiB) is held. Payloads that follow a record outside its size
  (AUXTRACE, TRACING_DATA) are skipped chunk by chunk, never buffered. Header-side sections are
  read whole but capped (``MAX_SECTION``), so an absurd size is an error, not an allocation.
- Cost: O(file size) for ``records()``; O(header + feature sections) for ``open``.

Only little-endian files are read (see ``perfheader``).
"""

from __future__ import annotations

import io
import os
import struct
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import IO, cast

from ..lightdc import replace
from .abi import RecordType
from .decoder import DecodeStats, RecordDecoder
from .formats import EventFormat
from .perfheader import (
    ATTR_SIZE_VER0,
    FILE_HEADER,
    FILE_HEADER_SIZE,
    MAX_ATTR_SIZE,
    OLD_FILE_HEADER_SIZE,
    PARSE_ERRORS,
    PIPE_HEADER_SIZE,
    SECTION,
    AttrInfo,
    BuildIdEntry,
    Feature,
    PerfDataError,
    feature_name,
    header_size,
    parse_attr,
    parse_attr_record,
    parse_build_id_record,
    parse_build_ids,
    parse_event_desc,
    parse_perf_string,
    parse_string_list,
)
from .records import Record

__all__ = ["CHUNK", "ERROR_HELP", "MAX_ATTRS", "PerfData"]

_HDR = struct.Struct("<IHH")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
CHUNK = 1 << 20  # data-section read size; bounds memory, see module invariants
MAX_SECTION = 64 << 20  # cap on any header-side section (attrs, ids, one feature) we read whole
MAX_ATTRS = 4096  # perf's own evlists are far smaller; bounds pipe-mode decoder rebuilds

# Explanations for ``PerfData.errors`` keys that need more than their name.
ERROR_HELP: dict[str, str] = {
    "compressed_unsupported": (
        "PERF_RECORD_COMPRESSED(2) records hold zstd-compressed records, which this reader "
        "does not decompress; they are yielded as records.Unknown. Re-record without -z/"
        "--compression-level, or run `perf inject -i in -o out` to decompress."
    ),
    "data_section_truncated": "the header's data section runs past the end of the file",
    "feature_table_truncated": "the feature section table after the data section is cut off",
    "attr_ids_bad": "an attr's ids section is out of bounds or not a multiple of 8",
    "attr_size_mismatch": "an attr's own size field disagrees with the header's attr_size",
    "event_desc_unmatched": "an EVENT_DESC entry names no attr we know",
    "payload_truncated": "an AUXTRACE/TRACING_DATA payload after its record is cut off",
}


# --------------------------------------------------------------------------- framing


class _Framer:
    """Splits a byte stream into (type, misc, body) frames, reading ``CHUNK``-sized pieces.

    ``limit`` is the number of bytes the stream may still supply (file mode: the rest of the
    data section); None reads to EOF (pipe mode). Uses ``read1`` when the stream has it, so a
    live pipe yields records as soon as they arrive instead of after a full chunk."""

    def __init__(
        self,
        stream: IO[bytes],
        limit: int | None,
        stats: DecodeStats,
        errors: Counter[str],
        chunk: int = CHUNK,
    ) -> None:
        read1 = getattr(stream, "read1", None)
        self._read = cast(Callable[[int], bytes], read1 if callable(read1) else stream.read)
        self._left = limit
        self._stats = stats
        self._errors = errors
        self._chunk = max(chunk, 8)
        self._buf = b""
        self._pos = 0

    def _fill(self, need: int) -> bool:
        """Make ``need`` bytes available at ``_pos``; False when the stream ends first."""
        avail = len(self._buf) - self._pos
        if avail >= need:
            return True
        parts = [self._buf[self._pos :]]
        while avail < need:
            want = max(need - avail, self._chunk)
            if self._left is not None:
                want = min(want, self._left)
                if want <= 0:
                    break
            data = self._read(want)
            if not data:
                break
            if self._left is not None:
                self._left -= len(data)
            parts.append(data)
            avail += len(data)
        self._buf = b"".join(parts)
        self._pos = 0
        return avail >= need

    def _skip(self, n: int) -> bool:
        """Drop ``n`` bytes of payload without holding more than one chunk of it."""
        while n > 0:
            avail = len(self._buf) - self._pos
            if avail == 0:
                if not self._fill(1):
                    return False
                continue
            take = min(n, avail)
            self._pos += take
            n -= take
        return True

    def frames(self) -> Iterator[tuple[int, int, memoryview]]:
        while True:
            if not self._fill(_HDR.size):
                if len(self._buf) > self._pos:
                    self._stats.errors["truncated"] += 1
                return
            rtype, misc, size = _HDR.unpack_from(self._buf, self._pos)
            if size < _HDR.size:
                self._stats.errors["bad_size"] += 1
                return
            if not self._fill(size):
                self._stats.errors["truncated"] += 1
                return
            body = memoryview(self._buf)[self._pos + _HDR.size : self._pos + size]
            self._pos += size
            extra = _payload_after(rtype, body)
            yield rtype, misc, body
            if extra and not self._skip(extra):
                self._errors["payload_truncated"] += 1
                return


def _payload_after(rtype: int, body: memoryview) -> int:
    """Bytes that follow a record outside its header.size (perf's session.c skips them).

    - PERF_RECORD_AUXTRACE: ``struct perf_record_auxtrace { header; u64 size; ... }`` then
      ``size`` bytes of AUX data (session.c perf_session__process_user_event).
    - PERF_RECORD_HEADER_TRACING_DATA: ``{ header; u32 size; }`` then ``size`` bytes padded
      to 8 (trace-event-read.c / perf_event__process_tracing_data)."""
    if rtype == RecordType.AUXTRACE and len(body) >= 8:
        return int(_U64.unpack_from(body, 0)[0])
    if rtype == RecordType.HEADER_TRACING_DATA and len(body) >= 4:
        n = int(_U32.unpack_from(body, 0)[0])
        return (n + 7) & ~7
    return 0


# --------------------------------------------------------------------------- reader


_PLACEHOLDER_FORMAT = EventFormat(sample_type=0, sample_id_all=False)

PathOrStream = str | os.PathLike[str] | IO[bytes]


class PerfData:
    """A perf.data file (file mode) or stream (pipe mode).

    File mode: ``open`` reads the header, the attrs and every feature section up front (so
    ``attrs`` have their EVENT_DESC names and ``build_ids``/``arch`` are known before the first
    record); ``records()`` then streams the data section and may be called again (it seeks
    back; the decoder's stats keep counting).

    Pipe mode (``perf record -o -``): the stream is a 16-byte header and then records only.
    ``attrs``, ``features``, ``arch``, ``build_ids`` and the other header values start empty
    and are filled *as* ``records()`` passes the HEADER_ATTR / HEADER_FEATURE /
    HEADER_BUILD_ID records that carry them (perf writes attrs and features first, build-ids,
    if any, last). Each new attr replaces ``decoder`` with one that knows every attr so far;
    all decoders share one ``DecodeStats``. ``records()`` can run only once.

    ``close()`` closes the stream only if ``open`` opened it (from a path)."""

    def __init__(self, stream: IO[bytes], *, owned: bool = False) -> None:
        self._stream = stream
        self._owned = owned
        self._consumed = False
        self.pipe_mode = False
        self.attrs: list[AttrInfo] = []
        self.build_ids: list[BuildIdEntry] = []
        self.arch: str | None = None
        self.hostname: str | None = None
        self.osrelease: str | None = None
        self.perf_version: str | None = None
        self.nr_cpus_avail: int | None = None
        self.nr_cpus_online: int | None = None
        self.cmdline: tuple[str, ...] | None = None
        self.features: dict[int, bytes] = {}
        self.errors: Counter[str] = Counter()
        self.data_offset = 0
        self.data_size = 0
        self._stats = DecodeStats()
        self.decoder = self._make_decoder()
        self._base = 0
        self._read_header()

    # -- opening

    @classmethod
    def open(cls, path_or_fileobj: PathOrStream) -> PerfData:
        """Open a path ("-" = stdin) or a binary stream positioned at the perf.data header.

        File mode needs a seekable stream; pipe mode works on anything with ``read``."""
        if isinstance(path_or_fileobj, str | os.PathLike):
            if os.fspath(path_or_fileobj) == "-":
                return cls(sys.stdin.buffer)
            try:
                f = open(path_or_fileobj, "rb")  # owned: closed by close()
            except OSError as e:
                raise PerfDataError(f"cannot open {os.fspath(path_or_fileobj)!r}: {e}") from e
            try:
                return cls(f, owned=True)
            except BaseException:
                f.close()
                raise
        return cls(path_or_fileobj)

    def close(self) -> None:
        if self._owned:
            self._stream.close()

    def __enter__(self) -> PerfData:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "pipe" if self.pipe_mode else "file"
        return (
            f"PerfData({mode}, attrs={len(self.attrs)}, build_ids={len(self.build_ids)}, "
            f"arch={self.arch!r}, errors={dict(self.errors)})"
        )

    # -- header

    def _read_exact(self, n: int) -> bytes:
        """Up to ``n`` bytes, fewer only at EOF (a raw stream may return short reads)."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            b = self._stream.read(n - got)
            if not b:
                break
            parts.append(b)
            got += len(b)
        return b"".join(parts)

    def _read_header(self) -> None:
        head = self._read_exact(PIPE_HEADER_SIZE)
        if len(head) < PIPE_HEADER_SIZE:
            raise PerfDataError(f"not perf.data: only {len(head)} bytes")
        size = header_size(head)
        if size == PIPE_HEADER_SIZE:
            self.pipe_mode = True
            return
        if not self._seekable():
            raise PerfDataError(
                "file-mode perf.data needs a seekable stream; use `perf record -o -` for pipes"
            )
        self._base = self._stream.tell() - PIPE_HEADER_SIZE
        rest = self._read_exact(FILE_HEADER_SIZE - PIPE_HEADER_SIZE)
        if len(rest) < size - PIPE_HEADER_SIZE:
            raise PerfDataError("perf.data header truncated")
        self._read_file_header(size, (head + rest).ljust(FILE_HEADER_SIZE, b"\0"))

    def _seekable(self) -> bool:
        try:
            return bool(self._stream.seekable())
        except (OSError, ValueError, AttributeError):
            return False

    def _file_bytes(self, off: int, size: int) -> bytes:
        self._stream.seek(self._base + off)
        return self._read_exact(size)

    def _read_file_header(self, hsize: int, raw: bytes) -> None:
        (_, _, attr_size, attrs_off, attrs_size, data_off, data_size, _, _, bitmap) = (
            FILE_HEADER.unpack(raw)
        )
        if hsize == OLD_FILE_HEADER_SIZE:
            bitmap = b""  # the bitmap postdates these files (perf_file_header__read)
        self._stream.seek(0, io.SEEK_END)
        file_size = self._stream.tell() - self._base

        # perf_file_attr = { perf_event_attr attr; perf_file_section ids; }, attr_size of them
        if not ATTR_SIZE_VER0 + SECTION.size <= attr_size <= MAX_ATTR_SIZE + SECTION.size:
            raise PerfDataError(f"bad attr_size {attr_size} in perf.data header")
        if attrs_size > MAX_SECTION or attrs_off + attrs_size > file_size:
            raise PerfDataError(
                f"attrs section [{attrs_off}, +{attrs_size}) is outside the file ({file_size} B)"
            )
        nattrs = attrs_size // attr_size
        if nattrs == 0:
            raise PerfDataError("perf.data has no event attrs")
        attr_blob = self._file_bytes(attrs_off, nattrs * attr_size)
        attrs: list[AttrInfo] = []
        for i in range(nattrs):
            entry = attr_blob[i * attr_size : (i + 1) * attr_size]
            try:
                fmt, atype, config, asize, stack_user, flags = parse_attr(
                    entry[: attr_size - SECTION.size]
                )
            except PARSE_ERRORS as e:
                raise PerfDataError(f"attr {i} does not parse: {e}") from e
            if asize != attr_size - SECTION.size:
                self.errors["attr_size_mismatch"] += 1
            ids_off, ids_size = SECTION.unpack_from(entry, attr_size - SECTION.size)
            ids: tuple[int, ...] = ()
            if ids_size % 8 or ids_size > MAX_SECTION or ids_off + ids_size > file_size:
                self.errors["attr_ids_bad"] += 1
            else:
                blob = self._file_bytes(ids_off, ids_size)
                ids = tuple(int(x) for x in struct.unpack(f"<{ids_size // 8}Q", blob))
            attrs.append(AttrInfo(fmt, atype, config, ids, "", stack_user, flags))
        self._set_attrs(attrs)

        self.data_offset = data_off
        self.data_size = data_size
        if data_off + data_size > file_size:
            # read what is there (perf would refuse; a cut-off recording is still worth reading)
            self.errors["data_section_truncated"] += 1
            self.data_offset = min(data_off, file_size)
            self.data_size = file_size - self.data_offset

        # header.c perf_header__process_sections: the table of perf_file_section, one per set
        # bit in ascending bit order, starts right after the data section as the header says
        # (feat_offset = data.offset + data.size), not where a truncated file ends.
        feats = [n for n in range(len(bitmap) * 8) if bitmap[n // 8] >> (n % 8) & 1]
        if not feats:
            return
        table_off = data_off + data_size
        table = b""
        if table_off + len(feats) * SECTION.size <= file_size:
            table = self._file_bytes(table_off, len(feats) * SECTION.size)
        if len(table) < len(feats) * SECTION.size:
            self.errors["feature_table_truncated"] += 1
            return
        for i, feat in enumerate(feats):
            off, size = SECTION.unpack_from(table, i * SECTION.size)
            if size > MAX_SECTION or off + size > file_size:
                self.errors[f"feature_{feature_name(feat)}_out_of_bounds"] += 1
                continue
            self._feature(feat, self._file_bytes(off, size))

    # -- attrs, features

    def _make_decoder(self) -> RecordDecoder:
        formats = [a.fmt for a in self.attrs] or [_PLACEHOLDER_FORMAT]
        ids = {i: n for n, a in enumerate(self.attrs) for i in a.ids}
        dec = RecordDecoder(formats, ids)
        dec.stats = self._stats  # one DecodeStats across every decoder this reader makes
        return dec

    def _set_attrs(self, attrs: list[AttrInfo]) -> None:
        self.attrs = attrs
        self.decoder = self._make_decoder()

    def _feature(self, feat: int, data: bytes) -> None:
        """Keep a feature section's raw bytes and parse the ones we use; count failures."""
        self.features[feat] = data
        try:
            if feat == Feature.BUILD_ID:
                self.build_ids.extend(parse_build_ids(data))
            elif feat == Feature.ARCH:
                self.arch = parse_perf_string(data, 0)[0]
            elif feat == Feature.HOSTNAME:
                self.hostname = parse_perf_string(data, 0)[0]
            elif feat == Feature.OSRELEASE:
                self.osrelease = parse_perf_string(data, 0)[0]
            elif feat == Feature.VERSION:
                self.perf_version = parse_perf_string(data, 0)[0]
            elif feat == Feature.NRCPUS:
                # header.c write_nrcpus: u32 nr_cpus_avail (max present cpu); u32 nr_cpus_online
                self.nr_cpus_avail, self.nr_cpus_online = struct.unpack_from("<II", data, 0)
            elif feat == Feature.CMDLINE:
                self.cmdline = parse_string_list(data)
            elif feat == Feature.EVENT_DESC:
                self._name_attrs(parse_event_desc(data))
        except PARSE_ERRORS:
            self.errors[f"feature_{feature_name(feat)}_corrupt"] += 1

    def _name_attrs(self, descs: list[tuple[str, tuple[int, ...], int, int]]) -> None:
        # perf (header.c process_event_desc -> evlist__set_event_name) finds each desc's
        # evsel by its first id; an attr without ids falls back to position.
        by_id = {i: n for n, a in enumerate(self.attrs) for i in a.ids}
        attrs = list(self.attrs)
        for pos, (name, ids, _, _) in enumerate(descs):
            idx = by_id.get(ids[0]) if ids else None
            if idx is None and pos < len(attrs) and not attrs[pos].ids:
                idx = pos
            if idx is None:
                self.errors["event_desc_unmatched"] += 1
                continue
            a = attrs[idx]
            attrs[idx] = replace(a, fmt=replace(a.fmt, name=name),
                                             name=name)  # fmt: skip
        self._set_attrs(attrs)

    def user_record(self, rtype: int, misc: int, body: memoryview) -> None:
        """Side effects of perf's synthesized records on the header view (pipe mode mostly)."""
        try:
            if rtype == RecordType.HEADER_ATTR:
                if len(self.attrs) >= MAX_ATTRS:
                    # each new attr rebuilds the decoder (O(attrs)): cap the quadratic case
                    self.errors["too_many_attrs"] += 1
                    return
                fmt, atype, config, ids, stack_user, flags = parse_attr_record(body)
                self._set_attrs([*self.attrs, AttrInfo(fmt, atype, config, ids, "",
                                                       stack_user, flags)])  # fmt: skip
            elif rtype == RecordType.HEADER_FEATURE:
                # struct perf_record_header_feature { header; u64 feat_id; char data[]; }
                (feat,) = _U64.unpack_from(body, 0)
                if feat != Feature.LAST_FEATURE_6_1 or len(body) > 8:
                    self._feature(int(feat), bytes(body[8:]))
            elif rtype == RecordType.HEADER_BUILD_ID:
                self.build_ids.append(parse_build_id_record(misc, body))
            elif rtype in (RecordType.COMPRESSED, RecordType.COMPRESSED2):
                self.errors["compressed_unsupported"] += 1
        except PARSE_ERRORS:
            self.errors[f"{_record_name(rtype)}_corrupt"] += 1

    # -- data

    def records(self) -> Iterator[Record]:
        """Every record of the data section (file mode) or stream (pipe mode), in order."""
        if self.pipe_mode:
            if self._consumed:
                raise PerfDataError("a pipe-mode stream can be read only once")
            self._consumed = True
            framer = _Framer(self._stream, None, self._stats, self.errors)
        else:
            self._stream.seek(self._base + self.data_offset)
            framer = _Framer(self._stream, self.data_size, self._stats, self.errors)
        for rtype, misc, body in framer.frames():
            if rtype >= RecordType.HEADER_ATTR:
                self.user_record(rtype, misc, body)
            yield self.decoder.decode_one(rtype, misc, body)


def _record_name(rtype: int) -> str:
    try:
        return RecordType(rtype).name.lower()
    except ValueError:
        return f"type{rtype}"
