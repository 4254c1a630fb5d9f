"""A table of which device holds which block of a tensor (``visualize_sharding``), drawn with rich."""

from __future__ import annotations

__all__ = ["render", "render_as_torch_xla"]


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


def render_as_torch_xla(cells: dict[tuple, list[int]], kind: str, use_color: bool, max_width: int = 80):
    """The table torch_xla's ``visualize_sharding`` draws for a sharding text: one cell per tile
    of the first two tile dims, each labelled with its device (``CPU 3``) or, for a tile held
    by several, their list (``CPU [0, 1]``), padded by one line and column; lines between the
    cells where there is no colour."""
    from rich import box
    from rich.align import Align
    from rich.console import Console
    from rich.padding import Padding
    from rich.style import Style
    from rich.table import Table

    console = Console(width=max_width)
    use_color = use_color and console.color_system is not None
    table = Table(show_header=False, show_lines=not use_color, padding=0, highlight=not use_color,
                  pad_edge=False, box=None if use_color else box.SQUARE)
    rows = sorted({b[0] for b in cells})
    cols = sorted({b[1] for b in cells})
    for r in rows:
        row = []
        for c in cols:
            devs = cells[(r, c)]
            label = f"{kind} {devs[0] if len(devs) == 1 else list(devs)}"
            row.append(Padding(Align(label, "center", vertical="middle"), (1, 1, 1, 1),
                               style=Style(bgcolor=None, color=None)))
        table.add_row(*row)
    console.print(table, end="\n\n")
    return table
