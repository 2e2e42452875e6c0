"""Prints the table of docs/real-clients.md from the figures the tests kept:

    FERROCACHE_CLIENT_FIGURES=/tmp/figures scripts/with-fake-cuda python -m pytest \\
        python/tests/real_torch/test_clients_real.py
    python3 python/tests/real_torch/clients/side_by_side.py /tmp/figures
"""

import json
import sys
from pathlib import Path

COLUMNS = [
    ("peak allocated", "peak_allocated"), ("peak reserved", "peak_reserved"),
    ("allocations", "allocations"), ("segments", "segments"), ("device frees", "device_frees"),
    ("retries", "retries"),
]  # fmt: skip


def cell(figure, native, ours):
    if ours is None:
        return f"{native[figure]:,} / (refused)"
    mark = "" if native[figure] == ours[figure] else " **differs**"
    return f"{native[figure]:,} / {ours[figure]:,}{mark}"


def rows(folder: Path):
    for native_path in sorted(folder.glob("*.native.json")):
        stem = native_path.name.removesuffix(".native.json")
        native = json.loads(native_path.read_text())
        ours_path = folder / f"{stem}.ferrocache.json"
        ours = json.loads(ours_path.read_text()) if ours_path.exists() else None
        # A job's figures are one per rank.
        per_rank = native if "figures" not in native else {"": native}
        for rank, one in per_rank.items():
            mine = None if ours is None else (ours if rank == "" else ours[rank])
            name = stem + (f" (rank {rank})" if rank != "" else "")
            if mine is None:
                steps = "(refused)"
            elif mine["steps"] == one["steps"] and mine["extra"] == one["extra"]:
                steps = "same"
            else:
                steps = "**differ**"
            cells = [cell(key, one["figures"], mine and mine["figures"]) for _, key in COLUMNS]
            yield [name, *cells, steps]


def main() -> None:
    folder = Path(sys.argv[1])
    columns = [f"{title} (native / ferrocache)" for title, _ in COLUMNS]
    head = ["client", *columns, "steps and own figures"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows(folder):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
