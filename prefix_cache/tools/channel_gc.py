"""`python -m prefix_cache channel gc`: remove the shared-memory namespaces whose owner died."""

from __future__ import annotations

from pathlib import Path

from prefix_cache.channel.shm import DeadNamespace, default_root, reclaim

_COLUMNS = ("namespace", "owner", "age", "entries", "bytes")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _table(dead: list[DeadNamespace]) -> list[str]:
    rows = [_COLUMNS] + [(d.directory.name, d.owner, _age(d.age_s), str(d.entries),
                          str(d.nbytes)) for d in dead]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return ["  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def main(root: Path | None, *, dry_run: bool) -> int:
    """Lists the namespaces under `root` whose owner died and removes them (not if `dry_run`)."""
    root = root or default_root()
    dead = reclaim(root, dry_run=dry_run)
    if not dead:
        print(f"no namespace of a dead owner under {root}")
        return 0
    print("\n".join(_table(dead)))
    verb = "would remove" if dry_run else "removed"
    print(f"{verb} {len(dead)} namespace{'s' if len(dead) > 1 else ''} of dead owners "
          f"under {root}")
    return 0
