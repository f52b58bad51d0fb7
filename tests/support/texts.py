"""Comparing long outputs (replays, renderings) with a failure message of bounded size.

pytest's own message for two unequal multi-megabyte strings is an ndiff of their lines, which
is quadratic: a broken replay then spends many minutes writing its failure instead of failing.
``assert_same_text`` says where the first difference is, and a few lines around it, in time
linear in the texts.
"""

from __future__ import annotations


def first_difference(got: str, want: str, context: int = 3) -> str | None:
    """None when equal, else the first differing line's number and a few lines of each."""
    if got == want:
        return None
    a, b = got.splitlines(), want.splitlines()
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    lo = max(0, i - context)
    return (
        f"first difference at line {i + 1} of {len(a)} (got) / {len(b)} (want)\n"
        f"got:\n  " + "\n  ".join(a[lo : i + context]) + "\n"
        "want:\n  " + "\n  ".join(b[lo : i + context])
    )


def assert_same_text(got: str, want: str, what: str = "") -> None:
    diff = first_difference(got, want)
    assert diff is None, f"{what}: {diff}" if what else diff
