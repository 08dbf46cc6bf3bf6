"""The two-column table (measure, value, note) the cluster benchmarks print."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(rows: Sequence[tuple[str, str, str]]) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"| {'measure':<{w0}} | {'value':>{w1}} | note")
    print(f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|------")
    for name, value, note in rows:
        print(f"| {name:<{w0}} | {value:>{w1}} | {note}")
