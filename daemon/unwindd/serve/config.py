"""The daemon's configuration: TOML bytes in, a frozen ``Config`` out.

Invariants:
- Sans-IO: ``parse_config`` takes the file's bytes and returns values or raises ``ConfigError``;
  it never opens files or reads the environment. ``load_config`` is the one edge that reads a
  path, and it alone decides that a missing *default* file means built-in defaults while a
  missing file the user named is an error.
- Every key is optional and has the default written in its dataclass field; the example file
  (``config.example.toml``) documents the same keys, and a test checks they agree.
- Unknown sections, unknown keys, wrong types and bad values are errors that name the key as
  ``[section] key`` — a typo never silently falls back to a default.
- Each key says whether a running daemon can apply it on SIGHUP (``live``) or needs a restart
  (the rings, the socket and the metrics listener are opened once); ``restart_keys`` compares
  two configs so reload can say exactly which changes wait for a restart.
- Cost: O(keys).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from ..binaries.cachefiles import DIR_MAX_BYTES
from ..lightdc import dataclass, field
from ..source.sampling import EVENTS, SPILL_MAX_BYTES

DEFAULT_PATH = "/etc/unwindd/config.toml"
DEFAULT_SOCKET = "/run/unwindd/unwindd.sock"
DEFAULTS_SOURCE = "<defaults>"  # Config.source when no file was read (the default path absent)
_MAX_CONFIG_BYTES = 1 << 20


class ConfigError(ValueError):
    """A config problem the operator can fix; the message names the file and the key."""


def _key(default: Any, *, live: bool, check: Callable[[Any], str | None] | None = None,
         doc: str = "") -> Any:  # fmt: skip
    meta = {"live": live, "check": check, "doc": doc}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {', '.join(map(repr, choices))}"

    return check


def _auto_or_power_of_two(v: Any) -> str | None:
    ok = 0 <= v <= 1 << 16 and not v & (v - 1)
    return None if ok else "must be 0 (auto) or a power of two <= 65536"


def _stack_size(v: Any) -> str | None:
    return None if 0 <= v <= 65528 and v % 8 == 0 else "must be a multiple of 8 in 0..65528"


def _mode(v: Any) -> str | None:
    return None if 0 <= v <= 0o777 else "must be a file mode in 0..0o777"


def _abs_path(v: Any) -> str | None:
    return None if v.startswith("/") else "must be an absolute path"


def parse_listen(v: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (IPv6 as ``[::1]:PORT``) -> (host, port)."""
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must look like '127.0.0.1:9464'")
    return host.strip("[]"), int(port)


def _listen(v: Any) -> str | None:
    try:
        parse_listen(v)
    except ValueError as e:
        return str(e)
    return None


def _cache_dir(v: Any) -> str | None:
    ok = v in ("", "off") or v.startswith("/")
    return None if ok else 'must be "", "off" or an absolute path'


def _pids(v: Any) -> str | None:
    ok = all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 1 << 31 for p in v)
    return None if ok else "must be a list of pids (positive integers)"


@dataclass(frozen=True, slots=True)
class SamplingSection:
    target: str = _key("all", live=False, check=_one_of("all", "pids", "cgroup"),
                       doc="what to sample: the whole machine, `pids`, or `cgroup`")  # fmt: skip
    pids: tuple[int, ...] = _key((), live=False, check=_pids)
    cgroup: str = _key("", live=False)
    event: str = _key("cpu-clock", live=False, check=_one_of(*EVENTS),
                      doc="perf's event name; `cycles` without a PMU falls back to `cpu-clock`")
    frequency: int = _key(99, live=False, check=_positive)
    stack_size: int = _key(8192, live=False, check=_stack_size)
    ring_pages: int = _key(0, live=False, check=_auto_or_power_of_two)
    spill_max_bytes: int = _key(SPILL_MAX_BYTES, live=False, check=_non_negative,
                                doc="memory the ring spill may hold; 0: no spill")  # fmt: skip


@dataclass(frozen=True, slots=True)
class UnwindSection:
    max_depth: int = _key(128, live=False, check=_positive)


@dataclass(frozen=True, slots=True)
class CacheSection:
    max_bytes: int = _key(512 << 20, live=False, check=_positive)
    dir: str = _key("", live=False, check=_cache_dir)
    dir_max_bytes: int = _key(DIR_MAX_BYTES, live=False, check=_positive)


CACHE_DIR_FALLBACK = "/var/cache/unwindd"


def cache_dir(section: CacheSection, env: Mapping[str, str]) -> str | None:
    """Where compiled CFI and symbol tables persist (``cfi/``, ``sym/`` below it), or None:
    ``[cache] dir``; "" is systemd's ``$CACHE_DIRECTORY`` (the unit's ``CacheDirectory=``,
    first entry) or /var/cache/unwindd; "off" keeps nothing on disk."""
    if section.dir == "off":
        return None
    if section.dir:
        return section.dir
    return env.get("CACHE_DIRECTORY", "").split(":")[0] or CACHE_DIR_FALLBACK



def _debuginfod_urls(v: Any) -> str | None:
    from ..binaries.debuginfod import parse_urls

    if v == "off":
        return None
    try:
        parse_urls(v)
    except ValueError as e:
        return f"{e} (space-separated http(s) URLs, \"\" or \"off\")"
    return None


@dataclass(frozen=True, slots=True)
class SymbolsSection:
    # debuginfod (binaries/debuginfod.py): servers asked by build-id for the debug info of
    # binaries that lack it locally; fetched in a worker, kept in debuginfod_cache
    debuginfod_urls: str = _key("", live=False, check=_debuginfod_urls,
                                doc='space-separated http(s) URLs; "" = $DEBUGINFOD_URLS, '
                                    '"off" = none')  # fmt: skip
    debuginfod_cache: str = _key("", live=False, check=lambda v: v and _abs_path(v),
                                 doc='"" = <[cache] dir>/debuginfod')  # fmt: skip
    debuginfod_timeout: float = _key(30.0, live=False, check=_positive)
    debuginfod_max_bytes: int = _key(1 << 30, live=False, check=_positive)
    debuginfod_negative_seconds: float = _key(600.0, live=False, check=_non_negative)
    # inline frames and source lines (binaries/srclines.py, tables compiled in a worker)
    inline: bool = _key(True, live=False,
                        doc="functions inlined by the compiler as frames of their own, and "
                            "file:line on frames (DWARF)")  # fmt: skip


@dataclass(frozen=True, slots=True)
class StoreSection:
    bucket_seconds: int = _key(10, live=False, check=_positive)
    retention_seconds: int = _key(3600, live=True, check=_positive)
    max_entries: int = _key(1_000_000, live=True, check=_positive)
    max_bytes: int = _key(12 << 20, live=True, check=_positive)


@dataclass(frozen=True, slots=True)
class ApiSection:
    socket: str = _key(DEFAULT_SOCKET, live=False, check=_abs_path)
    mode: int = _key(0o660, live=True, check=_mode)
    group: str = _key("", live=True)
    max_connections: int = _key(256, live=True, check=_positive)
    request_timeout: float = _key(10.0, live=True, check=_positive)
    max_header_bytes: int = _key(16384, live=True, check=_positive)
    max_body_bytes: int = _key(4096, live=True, check=_non_negative)
    max_stream_clients: int = _key(16, live=True, check=_positive)
    stream_queue: int = _key(10000, live=True, check=_positive)
    max_stacks: int = _key(100_000, live=True, check=_positive)


@dataclass(frozen=True, slots=True)
class MetricsSection:
    enabled: bool = _key(True, live=False)
    listen: str = _key("127.0.0.1:9464", live=False, check=_listen)


def _push_url(v: Any) -> str | None:
    from .pyroscope import check_url

    return check_url(v)


def _push_name(v: Any) -> str | None:
    from .pyroscope import check_app_name

    return check_app_name(v)


def _header_value(v: Any) -> str | None:
    ok = v == v.strip() and v.isprintable()
    return None if ok else "must be printable, without edge spaces (it is sent in a header)"


def _push_labels(v: Any) -> str | None:
    from .pyroscope import check_labels

    return check_labels(v)


def _listen_or_off(v: Any) -> str | None:
    return None if v == "" else _listen(v)


def _token(v: Any) -> str | None:
    ok = v.isprintable() and not any(c.isspace() for c in v)
    return None if ok else "must be printable, without spaces"


@dataclass(frozen=True, slots=True)
class ExportSection:
    pprof_listen: str = _key("", live=False, check=_listen_or_off,
                             doc="pull: HOST:PORT of /debug/pprof/profile; \"\" is off")
    pprof_token: str = _key("", live=False, check=_token)
    pprof_token_file: str = _key("", live=False, check=lambda v: v and _abs_path(v))
    pprof_max_seconds: int = _key(300, live=True, check=_positive)
    pprof_max_concurrent: int = _key(4, live=True, check=_positive)
    # push (Pyroscope): serve/pyroscope.py; opened at start, so every key waits for a restart
    pyroscope_url: str = _key("", live=False, check=_push_url,
                              doc='push: http(s)://HOST[:PORT] of Pyroscope; "" is off')
    app_name: str = _key("unwindd", live=False, check=_push_name)
    interval: int = _key(15, live=False, check=_positive)
    labels: Mapping[str, str] = _key({}, live=False, check=_push_labels)
    tenant_id: str = _key("", live=False, check=_header_value)
    basic_auth_user: str = _key("", live=False, check=lambda v: _header_value(v) or (
        "must not contain ':' (RFC 7617)" if ":" in v else None))
    basic_auth_password: str = _key("", live=False)
    basic_auth_password_file: str = _key("", live=False, check=lambda v: v and _abs_path(v))
    bearer_token: str = _key("", live=False, check=_header_value)
    timeout: float = _key(10.0, live=False, check=_positive)
    max_pending: int = _key(16, live=False, check=_positive)


@dataclass(frozen=True, slots=True)
class DaemonSection:
    tick_ms: int = _key(100, live=True, check=_positive)
    idle_tick_ms: int = _key(1000, live=True, check=_positive,
                             doc="the tick's period while the machine is idle (service.py _pace)")
    log_level: str = _key("info", live=True, check=_one_of("debug", "info", "warning", "error"))
    uid_cache_seconds: float = _key(10.0, live=True, check=_non_negative)


@dataclass(frozen=True, slots=True)
class PythonSection:
    frames: str = _key("replace", live=False, check=_one_of("replace", "beside", "off"),
                       doc="CPython 3.11+ functions in place of / beside the interpreter's "
                           "frames, or off")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Config:
    sampling: SamplingSection = field(default_factory=SamplingSection)
    unwind: UnwindSection = field(default_factory=UnwindSection)
    cache: CacheSection = field(default_factory=CacheSection)
    symbols: SymbolsSection = field(default_factory=SymbolsSection)
    store: StoreSection = field(default_factory=StoreSection)
    api: ApiSection = field(default_factory=ApiSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    export: ExportSection = field(default_factory=ExportSection)
    daemon: DaemonSection = field(default_factory=DaemonSection)
    python: PythonSection = field(default_factory=PythonSection)
    source: str = field(default=DEFAULTS_SOURCE, compare=False)

    def to_json(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for sec in fields(self):
            if sec.name == "source":
                continue
            s = getattr(self, sec.name)
            out[sec.name] = {f.name: _shown(sec.name, f.name, getattr(s, f.name))
                             for f in fields(s)}  # fmt: skip
        return out


# [export] keys whose values are credentials
SECRETS = frozenset({"basic_auth_password", "bearer_token", "pprof_token"})


def _shown(section: str, name: str, v: Any) -> Any:
    """A value as ``to_json`` shows it: as the config file spells it, so the output of
    ``check-config`` (and /v1/status's config) reads back as the same config (``SECRETS``
    excepted: they show as ``"<hidden>"``)."""
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    if section == "export" and name in SECRETS and v:
        return "<hidden>"  # /v1/status shows the config to every peer of the socket
    if section == "api" and name == "mode":
        return format(v, "04o")  # "0660", as _coerce reads it (and chmod(1) spells it)
    return v


SECTIONS: dict[str, type[Any]] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(Config)
    if f.name != "source"
}


def _coerce(section: str, name: str, ftype: Any, raw: Any) -> Any:
    """TOML value -> field value of the declared type, or a message saying what was wrong."""
    where = f"[{section}] {name}"
    t = ftype if isinstance(ftype, str) else getattr(ftype, "__name__", str(ftype))
    if name == "mode" and section == "api":
        # Modes read naturally as octal strings ("0660"); TOML's 0o660 integer works too.
        if isinstance(raw, str):
            try:
                return int(raw, 8)
            except ValueError:
                msg = f"{where}: must be an octal mode like \"0660\", got {raw!r}"
                raise ConfigError(msg) from None
        t = "int"
    if t == "bool":
        if isinstance(raw, bool):
            return raw
        raise ConfigError(f"{where}: must be true or false, got {raw!r}")
    if t == "int":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ConfigError(f"{where}: must be an integer, got {raw!r}")
    if t == "float":
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        raise ConfigError(f"{where}: must be a number, got {raw!r}")
    if t == "str":
        if isinstance(raw, str):
            return raw
        raise ConfigError(f"{where}: must be a string, got {raw!r}")
    if t.startswith(("dict", "Mapping")):
        if isinstance(raw, Mapping) and all(isinstance(x, str) for x in raw.values()):
            return dict(raw)
        raise ConfigError(f"{where}: must be a table of strings, got {raw!r}")
    if t.startswith("tuple"):
        if isinstance(raw, list):
            return tuple(raw)
        raise ConfigError(f"{where}: must be a list, got {raw!r}")
    raise AssertionError(f"unhandled type {t} for {where}")  # pragma: no cover


def _section(name: str, cls: type[Any], raw: Any) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"[{name}]: must be a table, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(
            f"[{name}] {unknown[0]}: unknown key (known keys: {', '.join(sorted(known))})"
        )
    values = {}
    for key, f in known.items():
        if key not in raw:
            continue
        v = _coerce(name, key, f.type, raw[key])
        check = f.metadata.get("check")
        msg = check(v) if check else None
        if msg:
            raise ConfigError(f"[{name}] {key}: {msg}, got {raw[key]!r}")
        values[key] = v
    return cls(**values)


def parse_config(data: bytes, source: str = "<config>") -> Config:
    """Parse and validate a whole config file; errors are ``ConfigError("SOURCE: [sec] key:
    why")``."""
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: TOML syntax error: {e}") from None
    try:
        unknown = sorted(set(doc) - set(SECTIONS))
        if unknown:
            raise ConfigError(
                f"[{unknown[0]}]: unknown section (known: {', '.join(sorted(SECTIONS))})"
            )
        secs = {name: _section(name, cls, doc[name]) for name, cls in SECTIONS.items()
                if name in doc}  # fmt: skip
        cfg = Config(**secs, source=source)
        _cross_check(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def _cross_check(cfg: Config) -> None:
    s = cfg.sampling
    if s.target == "pids" and not s.pids:
        raise ConfigError('[sampling] pids: target = "pids" needs a non-empty list')
    if s.target == "cgroup" and not s.cgroup:
        raise ConfigError('[sampling] cgroup: target = "cgroup" needs a cgroup directory')
    if cfg.store.retention_seconds < cfg.store.bucket_seconds:
        raise ConfigError("[store] retention_seconds: must be >= bucket_seconds")
    e = cfg.export
    if e.basic_auth_password and e.basic_auth_password_file:
        raise ConfigError("[export] basic_auth_password_file: set basic_auth_password or "
                          "basic_auth_password_file, not both")
    if e.bearer_token and (e.basic_auth_user or e.basic_auth_password or
                           e.basic_auth_password_file):  # fmt: skip
        raise ConfigError("[export] bearer_token: set basic auth or a bearer token, not both")
    if cfg.export.pprof_token and cfg.export.pprof_token_file:
        raise ConfigError("[export] pprof_token_file: set pprof_token or pprof_token_file, "
                          "not both")


def restart_keys(old: Config, new: Config) -> list[str]:
    """Keys whose value changed but that only take effect after a restart."""
    out = []
    for sec in SECTIONS:
        a, b = getattr(old, sec), getattr(new, sec)
        for f in fields(a):
            if not f.metadata["live"] and getattr(a, f.name) != getattr(b, f.name):
                out.append(f"[{sec}] {f.name}")
    return out


def changed_keys(old: Config, new: Config) -> list[str]:
    return [
        f"[{sec}] {f.name}"
        for sec in SECTIONS
        for f in fields(getattr(old, sec))
        if getattr(getattr(old, sec), f.name) != getattr(getattr(new, sec), f.name)
    ]


def load_config(path: str | None) -> Config:
    """The edge: ``path=None`` means the default file, which may be absent (built-in
    defaults); a path the user named must exist."""
    explicit = path is not None
    p = path if path is not None else DEFAULT_PATH
    try:
        with open(p, "rb") as fh:
            data = fh.read(_MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{p}: no such file") from None
        return Config()
    except OSError as e:
        raise ConfigError(f"{p}: {e.strerror or e}") from None
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: larger than {_MAX_CONFIG_BYTES} bytes")
    return parse_config(data, p)


def fallback_socket(uid: int | None = None, env: Mapping[str, str] | None = None) -> str:
    """Where the socket goes when the default directory cannot be created (not root): the
    user's runtime directory, else a per-uid directory in /tmp. ``unwindctl`` looks there too."""
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    base = env.get("XDG_RUNTIME_DIR") or f"/tmp/unwindd-{uid}"
    return os.path.join(base, "unwindd", "unwindd.sock") if "XDG_RUNTIME_DIR" in env else \
        os.path.join(base, "unwindd.sock")  # fmt: skip


def merge_live(running: Config, new: Config) -> Config:
    """The config a reload actually puts in effect: live keys from ``new``, the rest (which
    wait for a restart) from ``running``."""
    secs = {}
    for sec in SECTIONS:
        a, b = getattr(running, sec), getattr(new, sec)
        vals = {f.name: getattr(b if f.metadata["live"] else a, f.name) for f in fields(a)}
        secs[sec] = type(a)(**vals)
    return Config(**secs, source=new.source)
