"""Labels fleets group profiles by: each process's cgroup path, systemd unit and container id,
from ``/proc/<pid>/cgroup`` (cgroups(7)).

Invariants:
- Parsing is pure and total: ``cgroup_path`` and ``labels_of_path`` never raise, on any text,
  and their output is bounded and printable (the path at ``MAX_PATH`` printable chars, else no
  cgroup label: a directory name may hold any byte but "/"; a unit at systemd's
  UNIT_NAME_MAX of its unit-name characters; a container id is 64 hex digits).
- The cgroup: cgroup v2's ``0::/path`` line; on a hybrid or v1-only machine (no v2 line, or a
  v2 line at the root) systemd's own ``name=systemd`` hierarchy, then the first v1 controller
  path below the root (v1 docker puts every controller at ``/docker/<id>``).
- The unit: the innermost cgroup path component that is a systemd unit name of type
  ``.service`` or ``.scope`` (a user manager's ``user@1000.service/app.slice/x.scope`` is
  ``x.scope``, what systemd's ``cg_path_get_user_unit`` answers), else the innermost
  ``.slice``; systemd's cgroup escape (a leading ``_``, src/basic/cgroup-util.c cg_escape) is
  undone.
- The container id: the innermost component that is a 64-hex id, bare (``/docker/<id>``,
  cgroupfs-driver ``/kubepods/<qos>/pod<uid>/<id>``) or as a runtime's systemd scope
  (``docker-``, ``cri-containerd-``, ``crio-``, ``libpod-`` + id + ``.scope``), the forms the
  OpenTelemetry eBPF profiler's containermetadata/containermetadata.go matches (its
  dockerPattern, kubePattern, systemdKubePattern). conmon's scopes (``crio-conmon-``,
  ``libpod-conmon-``) are the runtime monitor, not the container: no id.
- ``CgroupLabels`` reads a pid's file once per event that may change it (bootstrap, a /proc
  rescan, exec; a FORK only forgets the pid: read lazily at its first stored sample). An exec
  of a pid whose labels are not held (a new process: its FORK forgot it) is not read at once
  but marked ``due``: read at the pid's first placed sample (``read_due``, livetable.py), or
  at its first stored sample; a process that exits before either (most of a churning
  machine's) is never read. It keeps
  at most ``max_pids`` pids (oldest read dropped first) and parses each distinct path once
  (``max_paths`` cached, then the cache starts over). A pid whose file cannot be read (the
  process is gone) has no labels, counted in ``stats.unreadable``; never another's.
- A file longer than the read limit loses its cut last line (one without its newline), never
  yields a cut path.
- Cost: a read is one open and one read of a small file (at most 16 KiB read) plus a dict
  lookup; nothing here runs per sample.
"""

from __future__ import annotations

from collections.abc import Callable

from ..lightdc import dataclass
from .procscan import ProcFS

__all__ = ["NO_LABELS", "CgroupLabels", "CgroupStats", "Labels", "cgroup_path", "labels_of_path"]

MAX_PATH = 1024  # longer cgroup paths give no cgroup label (counted): a label stays small
_READ_LIMIT = 16384  # a v1 machine has a line per hierarchy, each path up to PATH_MAX
UNIT_NAME_MAX = 256  # systemd src/basic/unit-name.h
_HEX = frozenset("0123456789abcdef")
_UNIT_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-_.\\@"
)  # systemd's VALID_CHARS plus "@" (unit-name.c)
# A runtime's scope: prefix + 64-hex id + ".scope" (docker and podman with the systemd cgroup
# driver, containerd's and cri-o's CRI plugins with SystemdCgroup)
_SCOPE_PREFIXES = ("docker-", "cri-containerd-", "crio-", "libpod-")


@dataclass(frozen=True, slots=True)
class Labels:
    cgroup: str | None = None
    unit: str | None = None
    container_id: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The labels that are known, by their API names."""
        out: dict[str, str] = {}
        if self.cgroup is not None:
            out["cgroup"] = self.cgroup
        if self.unit is not None:
            out["unit"] = self.unit
        if self.container_id is not None:
            out["container_id"] = self.container_id
        return out


NO_LABELS = Labels()


def cgroup_path(text: str) -> str | None:
    """The process's cgroup from the text of ``/proc/<pid>/cgroup`` (``hierarchy-ID:controller
    list:path`` lines; the v2 line is ``0::path``). None: no usable line."""
    v2 = named = v1 = None
    for line in text.splitlines():
        hid, sep, rest = line.partition(":")
        ctrl, sep2, path = rest.partition(":")
        if not sep or not sep2 or not path.startswith("/"):
            continue
        if hid == "0" and ctrl == "":
            v2 = path
        elif ctrl == "name=systemd":
            named = path
        elif v1 is None and path != "/":
            v1 = path
    if v2 is not None and v2 != "/":
        return v2
    if named is not None and named != "/":
        return named
    return v1 or v2 or named


def _unit_name(comp: str) -> tuple[str, str] | None:
    """(name, type) when ``comp`` is a systemd unit name of a type cgroups hold."""
    if comp.startswith("_"):
        comp = comp[1:]  # cg_unescape
    base, dot, kind = comp.rpartition(".")
    if (not dot or not base or kind not in ("service", "scope", "slice")
            or len(comp) > UNIT_NAME_MAX or not _UNIT_CHARS.issuperset(comp)):  # fmt: skip
        return None
    return comp, kind


def _container_id(comp: str) -> str | None:
    if len(comp) == 64 and _HEX.issuperset(comp):
        return comp
    if comp.endswith(".scope") and len(comp) > 70:
        body = comp[:-6]
        for prefix in _SCOPE_PREFIXES:
            if body.startswith(prefix):
                cid = body[len(prefix):]
                if len(cid) == 64 and _HEX.issuperset(cid):
                    return cid
    return None


def labels_of_path(path: str | None) -> Labels:
    """The labels a cgroup path implies (see the module's rules)."""
    if path is None:
        return NO_LABELS
    unit = slice_ = cid = None
    for comp in reversed(path.split("/")):
        if unit is None:
            got = _unit_name(comp)
            if got is not None:
                if got[1] != "slice":
                    unit = got[0]
                elif slice_ is None:
                    slice_ = got[0]
        if cid is None:
            cid = _container_id(comp)
        if unit is not None and cid is not None:
            break
    cg = path if len(path) <= MAX_PATH and path.isprintable() else None
    return Labels(cg, unit or slice_, cid)


@dataclass
class CgroupStats:
    reads: int = 0
    unreadable: int = 0  # the process was gone (or the file unreadable): no labels
    unparsed: int = 0  # read, but no cgroup line in it
    # a path past MAX_PATH or not printable: no cgroup label (unit and id still parsed)
    unlabelled_path: int = 0


class CgroupLabels:
    """pid -> ``Labels``, read from ``<proc_root>/<pid>/cgroup``; see the module's rules.
    ``listeners`` are told ``(pid, labels or None)`` whenever a pid's labels are set or
    forgotten (the store keeps them per process with its samples)."""

    def __init__(self, procfs: ProcFS, *, max_pids: int = 32768, max_paths: int = 4096) -> None:
        self.procfs = procfs
        self.max_pids = max_pids
        self.max_paths = max_paths
        self.stats = CgroupStats()
        self._by_pid: dict[int, Labels] = {}
        # pids exec'd while their labels were not held: read at their first placed sample
        # (insertion order: the oldest dropped past max_pids, read lazily by labels_for then)
        self.due: dict[int, None] = {}
        self._by_path: dict[str, Labels] = {}
        self.listeners: list[Callable[[int, Labels | None], None]] = []

    def read(self, pid: int) -> Labels | None:
        """Read ``pid``'s cgroup now; None (and the pid forgotten) if it cannot be read."""
        st = self.stats
        st.reads += 1
        if self.due:
            self.due.pop(pid, None)
        text = self.procfs.read(pid, "cgroup", _READ_LIMIT)
        if text is None:
            st.unreadable += 1
            self.forget(pid)
            return None
        if not text.endswith("\n"):
            # the kernel ends every line (kernel/cgroup/cgroup.c proc_cgroup_show): one without
            # its newline was cut by the read limit, and a partial path is no path
            text = text[: text.rfind("\n") + 1]
        path = cgroup_path(text)
        if path is None:
            st.unparsed += 1
            labels = NO_LABELS
        else:
            cached = self._by_path.get(path)
            if cached is None:
                if len(self._by_path) >= self.max_paths:
                    self._by_path.clear()
                cached = labels_of_path(path)
                if cached.cgroup is None:
                    st.unlabelled_path += 1
                self._by_path[path] = cached
            labels = cached
        by_pid = self._by_pid
        by_pid.pop(pid, None)  # re-inserted: the newest read is the last to go
        by_pid[pid] = labels
        if len(by_pid) > self.max_pids:
            del by_pid[next(iter(by_pid))]
        for cb in self.listeners:
            cb(pid, labels)
        return labels

    def exec(self, pid: int) -> None:
        """``pid`` exec'd (its cgroup may have changed: runtimes move a process before its
        exec): read now if its labels are held (the store shows them), else when its first
        sample is placed (``read_due``) or stored (``labels_for``)."""
        if pid in self._by_pid:
            self.read(pid)
            return
        due = self.due
        due[pid] = None
        if len(due) > self.max_pids:
            del due[next(iter(due))]

    def read_due(self, pid: int) -> None:
        """A sample of ``pid`` was placed: its labels, if an exec left them due, read now."""
        if pid in self.due:
            self.read(pid)

    def forget(self, pid: int) -> None:
        """``pid`` may now be another process (FORK) or its cgroup may have changed: its
        labels are read again when next wanted."""
        self._by_pid.pop(pid, None)
        if self.due:
            self.due.pop(pid, None)
        for cb in self.listeners:
            cb(pid, None)

    def get(self, pid: int) -> Labels | None:
        """The labels last read for ``pid``, without reading."""
        return self._by_pid.get(pid)

    def labels_for(self, pid: int) -> Labels | None:
        """``pid``'s labels, read now if not known (None: it could not be read)."""
        got = self._by_pid.get(pid)
        return got if got is not None else self.read(pid)

    def __len__(self) -> int:
        return len(self._by_pid)
