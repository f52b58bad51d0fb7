"""Config parsing (sans-IO) and the load edge: defaults, every key, errors that name the key,
reload classification, and config.example.toml documenting exactly the real keys."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
from unwindd.serve.config import (
    SECTIONS,
    Config,
    ConfigError,
    cache_dir,
    load_config,
    merge_live,
    parse_config,
    parse_listen,
    restart_keys,
)

ROOT = Path(__file__).resolve().parents[2]


def test_empty_file_is_all_defaults() -> None:
    assert parse_config(b"") == Config()
    c = Config()
    assert c.sampling.frequency == 99 and c.sampling.target == "all"
    assert c.api.socket == "/run/unwindd/unwindd.sock" and c.api.mode == 0o660
    assert c.metrics.listen == "127.0.0.1:9464"


def test_keys_scripts_rely_on() -> None:
    c = parse_config(b'[api]\nsocket = "/tmp/x.sock"\nmode = "0600"\ngroup = "adm"\n'
                     b'[metrics]\nlisten = "127.0.0.1:9999"\n[sampling]\nfrequency = 1000\n')
    assert c.api.socket == "/tmp/x.sock" and c.api.mode == 0o600 and c.api.group == "adm"
    assert parse_listen(c.metrics.listen) == ("127.0.0.1", 9999)
    assert c.sampling.frequency == 1000
    assert parse_config(b"[api]\nmode = 0o640\n").api.mode == 0o640
    assert parse_listen("[::1]:80") == ("::1", 80)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (b"[sampling]\nfrequncy = 10\n", "[sampling] frequncy: unknown key"),
        (b"[sampler]\n", "[sampler]: unknown section"),
        (b"[sampling]\nfrequency = 0\n", "[sampling] frequency: must be > 0"),
        (b'[sampling]\nfrequency = "99"\n', "[sampling] frequency: must be an integer"),
        (b"[sampling]\nfrequency = true\n", "[sampling] frequency: must be an integer"),
        (b"[sampling]\nstack_size = 100\n", "[sampling] stack_size: must be a multiple of 8"),
        (b"[sampling]\nring_pages = 3\n", "[sampling] ring_pages: must be 0 (auto) or a power"),
        (b"[sampling]\nring_pages = -64\n", "[sampling] ring_pages: must be 0 (auto) or a power"),
        (b"[sampling]\nspill_max_bytes = -1\n", "[sampling] spill_max_bytes: must be >= 0"),
        (b'[sampling]\nevent = "cycle"\n', "[sampling] event: must be one of"),
        (b'[sampling]\ntarget = "pids"\n', "[sampling] pids: target = \"pids\" needs"),
        (b"[sampling]\npids = [0]\n", "[sampling] pids: must be a list of pids"),
        (b'[api]\nsocket = "rel.sock"\n', "[api] socket: must be an absolute path"),
        (b'[api]\nmode = "rw"\n', "[api] mode: must be an octal mode"),
        (b"[api]\nmode = 0o1777\n", "[api] mode: must be a file mode"),
        (b"[api]\nrequest_timeout = -1\n", "[api] request_timeout: must be > 0"),
        (b'[metrics]\nlisten = "9464"\n', "[metrics] listen: must look like"),
        (b'[metrics]\nenabled = "yes"\n', "[metrics] enabled: must be true or false"),
        (b'[daemon]\nlog_level = "loud"\n', "[daemon] log_level: must be one of"),
        (b"[store]\nretention_seconds = 5\n", "[store] retention_seconds: must be >="),
        (b"[store]\nmax_bytes = 0\n", "[store] max_bytes: must be > 0"),
        (b'[cache]\ndir = "rel/dir"\n', '[cache] dir: must be "", "off" or an absolute path'),
        (b"sampling = 3\n", "[sampling]: must be a table"),
        (b"[sampling\n", "TOML syntax error"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_errors_name_the_key(text: bytes, names: str) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "f.toml")
    assert str(ei.value).startswith("f.toml: ") and names in str(ei.value)


def test_load_edge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("unwindd.serve.config.DEFAULT_PATH", str(tmp_path / "absent.toml"))
    assert load_config(None) == Config()  # missing default file: built-in defaults
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "absent.toml"))  # missing named file: error
    p = tmp_path / "c.toml"
    p.write_bytes(b"[daemon]\ntick_ms = 50\n")
    c = load_config(str(p))
    assert c.daemon.tick_ms == 50 and c.source == str(p)


def test_reload_classification() -> None:
    old = Config()
    new = parse_config(b"[sampling]\nfrequency = 1000\n[store]\nmax_entries = 5\n"
                       b"[api]\nrequest_timeout = 2.0\n")
    assert restart_keys(old, new) == ["[sampling] frequency"]
    eff = merge_live(old, new)
    assert eff.sampling.frequency == 99  # waits for a restart
    assert eff.store.max_entries == 5 and eff.api.request_timeout == 2.0  # applied live


def test_example_documents_every_key_with_its_default() -> None:
    doc = tomllib.loads((ROOT / "config.example.toml").read_text())
    assert parse_config((ROOT / "config.example.toml").read_bytes()) == Config()
    for sec, cls in SECTIONS.items():
        assert sec in doc, f"[{sec}] missing from config.example.toml"
        want = {f.name for f in fields(cls)}
        assert set(doc[sec]) == want, (sec, set(doc[sec]) ^ want)


def test_check_config_command(tmp_path: Path) -> None:
    ok = tmp_path / "ok.toml"
    ok.write_text("[sampling]\nfrequency = 50\n")
    res = subprocess.run([sys.executable, "-m", "unwindd.cli", "check-config", str(ok)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and '"frequency": 50' in res.stdout, res.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[api]\nmax_connections = 0\n")
    res = subprocess.run([sys.executable, "-m", "unwindd.cli", "check-config", str(bad)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert res.stderr.strip() == (f"unwindd: error: {bad}: [api] max_connections: must be > 0,"
                                  " got 0")
    res = subprocess.run([sys.executable, "-m", "unwindd.cli", "run", "--config",
                          str(tmp_path / "nope.toml")], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "nope.toml: no such file" in res.stderr


def test_store_max_bytes_changes_live() -> None:
    assert Config().store.max_bytes == 12 << 20
    new = parse_config(b"[store]\nmax_bytes = 1048576\n")
    assert new.store.max_bytes == 1 << 20
    # The reload path sets the running store's cap (service.Daemon reload), no restart needed.
    assert restart_keys(Config(), new) == []
    assert merge_live(Config(), new).store.max_bytes == 1 << 20


def test_cache_dir() -> None:
    """[cache] dir: "" is systemd's CacheDirectory (first entry) or /var/cache/unwindd, "off"
    is none, a path is itself."""
    def of(text: bytes, env: dict[str, str]) -> str | None:
        return cache_dir(parse_config(text, "f.toml").cache, env)

    assert of(b"", {}) == "/var/cache/unwindd"
    assert of(b"", {"CACHE_DIRECTORY": "/var/cache/unwindd2:/var/cache/x"}) == "/var/cache/unwindd2"
    assert of(b'[cache]\ndir = "off"\n', {"CACHE_DIRECTORY": "/c"}) is None
    assert of(b'[cache]\ndir = "/srv/c"\n', {"CACHE_DIRECTORY": "/c"}) == "/srv/c"


def test_to_json_reads_back_as_the_same_config() -> None:
    """What check-config prints (``to_json``) is a config: each value as a file spells it, the
    socket mode as an octal string."""
    import json

    text = (b'[sampling]\ntarget = "pids"\npids = [1, 2]\nfrequency = 7\n[api]\nmode = 0o640\n'
            b'group = "adm"\nrequest_timeout = 2.5\n[metrics]\nenabled = false\n')
    c = parse_config(text)
    shown = c.to_json()
    assert shown["api"]["mode"] == "0640"
    again = "".join(f"[{sec}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
                    for sec, keys in shown.items())  # fmt: skip
    assert parse_config(again.encode()) == c
    assert Config().to_json()["api"]["mode"] == "0660"
