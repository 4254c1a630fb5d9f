"""A table of which device holds which block of a tensor (``visualize_sharding``), drawn with rich."""

from __future__ import annotations

__all__ = ["render"]


def render(cells: dict[tuple, list[int]], kind: str, use_color: bool):
    """A table of ``{(row block, col block): devices}``, each block ``(start, length)``."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rows = sorted({b[0] for b in cells})
    cols = sorted({b[1] for b in cells})
    table = Table(show_header=False, show_lines=True, box=box.SQUARE, padding=(0, 1))
    palette = ["red", "green", "blue", "magenta", "cyan", "yellow", "bright_red", "bright_green"]
    for c in cols:
        table.add_column(justify="center", ratio=max(1, c[1]))
    for r in rows:
        row = []
        for c in cols:
            devs = cells.get((r, c), [])
            label = f"{kind} {','.join(map(str, sorted(devs)))}" if devs else ""
            style = palette[(rows.index(r) * len(cols) + cols.index(c)) % len(palette)] if use_color else None
            row.append(Text(label, style=f"on {style}" if style else ""))
        table.add_row(*row)
    Console().print(table)
    return table
