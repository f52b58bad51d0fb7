"""The push's sans-IO parts: the ``[export]`` keys and their refusals, the series split (one
profile per label set, static labels kept), label values Pyroscope's labelset.Parse reads back
unchanged, and the wall-clock anchoring that makes consecutive windows share their edges."""

from __future__ import annotations

import base64

import pytest
from unwindd.serve.config import ConfigError, parse_config
from unwindd.serve.pyroscope import (
    Clock,
    PushConfig,
    ingest_target,
    label_value,
    series_name,
    split_series,
)
from unwindd.store.queries import StackCount
from unwindd.unwind.stackfmt import Frame


def test_export_keys_parse_and_hide_secrets() -> None:
    cfg = parse_config(b'[export]\npyroscope_url = "https://p.example:4040/base"\n'
                       b'labels = { env = "prod", "k8s.ns" = "a-b" }\n'
                       b'basic_auth_user = "u"\nbasic_auth_password = "pw"\n')  # fmt: skip
    assert cfg.export.labels == {"env": "prod", "k8s.ns": "a-b"}
    shown = cfg.to_json()["export"]
    assert shown["basic_auth_password"] == "<hidden>" and shown["labels"] == {"env": "prod",
                                                                             "k8s.ns": "a-b"}
    push = PushConfig.from_section(cfg.export, frequency=99, hostname="h1")
    assert ("Authorization", "Basic " + base64.b64encode(b"u:pw").decode()) in push.headers
    assert push.labels == {"hostname": "h1", "env": "prod", "k8s.ns": "a-b"}


@pytest.mark.parametrize(("toml", "where"), [
    ('pyroscope_url = "ftp://x"', "[export] pyroscope_url"),
    ('pyroscope_url = "http://u:p@x:4040"', "[export] pyroscope_url"),
    ('app_name = "my app"', "[export] app_name"),
    ('labels = { "bad-name" = "x" }', "[export] labels"),
    ('labels = { __name__ = "x" }', "[export] labels"),
    ('labels = { env = "a,b" }', "[export] labels"),
    ('labels = { env = "a}" }', "[export] labels"),
    ("labels = { env = 3 }", "[export] labels"),
    ("interval = 0", "[export] interval"),
    ('basic_auth_password = "a"\nbasic_auth_password_file = "/x"',
     "[export] basic_auth_password_file"),
    ('bearer_token = "t"\nbasic_auth_user = "u"', "[export] bearer_token"),
    ('tenant_id = "a\\r\\nX-Evil: 1"', "[export] tenant_id"),
    ('basic_auth_user = "a:b"', "[export] basic_auth_user"),
])  # fmt: skip
def test_export_refusals_name_the_key(toml: str, where: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(f"[export]\n{toml}\n".encode())
    assert str(e.value).startswith(f"<config>: {where}:"), e.value


def _sc(pid: int, n: int) -> StackCount:
    return StackCount(pid, pid, f"p{pid}", (Frame(0x10, "/bin/x", "f", 0),), n)


def test_split_series_one_profile_per_label_set() -> None:
    stacks = [_sc(1, 5), _sc(2, 3), _sc(3, 2)]
    base = {"hostname": "h", "env": "ci"}
    assert split_series(stacks, base, None) == {(("env", "ci"), ("hostname", "h")): stacks}
    units = {1: "a.service", 2: "b.service"}
    got = split_series(stacks, base, lambda s: {"systemd_unit": units.get(s.pid, ""),
                                                "env": "override?"})  # fmt: skip
    assert got == {
        (("env", "ci"), ("hostname", "h"), ("systemd_unit", "a.service")): [stacks[0]],
        (("env", "ci"), ("hostname", "h"), ("systemd_unit", "b.service")): [stacks[1]],
        (("env", "ci"), ("hostname", "h")): [stacks[2]],  # no label: the static series
    }


def test_dynamic_label_values_survive_the_name_parser() -> None:
    assert label_value(" docker://abc,def} ") == "docker://abc_def_"
    name = series_name("app", (("cgroup", label_value("/a,b}/c")), ("hostname", "h")))
    assert name == "app{cgroup=/a_b_/c,hostname=h}"
    target = ingest_target("app", (("hostname", "h"),), 100, 110, 99)
    assert target == ("/ingest?name=app%7Bhostname%3Dh%7D&from=100&until=110&format=pprof"
                      "&sampleRate=99&spyName=unwindd")


def test_clock_keeps_consecutive_edges_and_follows_a_step() -> None:
    c = Clock()
    off = 1_700_000_000_400_000_000  # wall - mono, 0.4 s past a whole second
    a = c.unix(10_000_000_000, off)
    b = c.unix(20_000_000_000, off + 300_000_000)  # the offset drifted 0.3 s: same grid
    assert b - a == 10
    d = c.unix(30_000_000_000, off + 5_000_000_000)  # the wall clock stepped 5 s: follow it
    assert d - b == 15
