"""Tables the commands print, as wide as the terminal and never wider.

The width is the terminal's (``COLUMNS`` when set; 80 without a terminal, as when piped). A table is drawn
as a table when its columns fit, each at least as wide as its longest word, and otherwise as one block per
row (the row's first cell, then ``header  value`` for the others: prose on its own lines, short values side
by side as the width allows). No cell loses a character: text
wraps between words, and a word wider than its column (a long identifier) breaks after ``(``, ``,``, ``=``
or ``/`` -- where rich, left alone, cuts cells short with an ellipsis.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

_BREAK_AFTER = "(,=/"
_PIECE = re.compile(
    rf"[^{re.escape(_BREAK_AFTER)}]*[{re.escape(_BREAK_AFTER)}]|[^{re.escape(_BREAK_AFTER)}]+"
)
# rich's default box: a border before every column and after the last, one space of padding on each side
_BORDER_PER_COLUMN, _BORDER_AT_END = 3, 1
_INDENT = 2  # of a stacked row's ``header  value`` lines
_SLOT_GAP = 3  # between two ``header  value`` slots on one line


def terminal_width() -> int:
    """Columns of the terminal: ``COLUMNS`` if set, else the terminal's size, else 80."""
    return shutil.get_terminal_size((80, 24)).columns


def terminal_console() -> Console:
    """A rich console as wide as :func:`terminal_width`."""
    return Console(width=terminal_width())


@dataclass(frozen=True)
class Column:
    """A column of :func:`fit_table`: its header, how its cells align, and whether they hold prose that
    may wrap over several lines (other cells keep to one line while the table is drawn as a table)."""

    header: str
    justify: Literal["left", "right", "center"] = "left"
    wrap: bool = False


Cell = str | Text  # a str is rich markup ("[green]yes[/green]")


def fit_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[Cell]],
    *,
    width: int,
    title: str | None = None,
    row_styles: Sequence[str | None] | None = None,
    show_header: bool = True,
) -> Table | Text:
    """``rows`` under ``columns`` in at most ``width`` columns: a table if it fits, else stacked rows.

    Args:
        row_styles: a rich style per row (``"bold"`` for the recommended one), or ``None``.
        show_header: ``False`` for a table of names and values, whose headers say nothing.
    """
    cells = [[_text(c) for c in row] for row in rows]
    if any(len(row) != len(columns) for row in cells):
        raise ValueError(f"every row needs {len(columns)} cells, one per column: {[len(r) for r in cells]}")
    styles = list(row_styles) if row_styles is not None else [None] * len(cells)
    widths = _column_widths(
        columns if show_header else [Column("", c.justify, c.wrap) for c in columns], cells, width
    )
    if widths is None:
        return _stacked(columns, cells, width, title, styles, show_header)
    table = Table(title=title, show_header=show_header)
    for col, w in zip(columns, widths):
        table.add_column(_wrapped(Text(col.header), w), justify=col.justify, width=w, no_wrap=True)
    for row, style in zip(cells, styles):
        table.add_row(*(_wrapped(c, w) for c, w in zip(row, widths)), style=style)
    return table


def _text(cell: Cell) -> Text:
    return cell.copy() if isinstance(cell, Text) else Text.from_markup(str(cell))


def _column_widths(columns: Sequence[Column], cells: list[list[Text]], width: int) -> list[int] | None:
    """Each column's width when the table fits in ``width``, else ``None``: every column at least its
    longest unbreakable piece (headers and prose wrap, other cells do not); what is left widens, a few
    characters at a time, the column that saves the most lines per character (rows first, then lines)."""
    grid = [[Text(c.header) for c in columns], *cells]  # the header is a row too
    low, high = [], []
    for j, col in enumerate(columns):
        texts = [row[j].plain for row in cells]
        header = _longest_piece(col.header)
        if col.wrap:
            low.append(max([header, *(_longest_piece(t) for t in texts)]))
        else:
            low.append(max([header, *(_line_width(t) for t in texts)]))
        high.append(max([low[j], _line_width(col.header), *(_line_width(t) for t in texts)]))
    spare = width - sum(low) - _BORDER_PER_COLUMN * len(columns) - _BORDER_AT_END
    if spare < 0:
        return None
    lines: dict[tuple[int, int], list[int]] = {}  # (column, width) -> lines of each row's cell

    def column_lines(j: int, w: int) -> list[int]:
        if (j, w) not in lines:
            lines[j, w] = [max(1, len(_line_spans(row[j].plain, w))) for row in grid]
        return lines[j, w]

    def cost(widths: list[int]) -> tuple[int, int]:
        per_column = [column_lines(j, w) for j, w in enumerate(widths)]
        return sum(max(row) for row in zip(*per_column)), sum(map(sum, per_column))

    widths = list(low)
    while spare > 0:
        now = cost(widths)
        best: tuple[float, float, int, int] | None = None  # (rows saved, lines saved) per character, j, k
        for j in range(len(columns)):
            for k in range(1, min(spare, high[j] - widths[j]) + 1):
                after = cost([w + k if i == j else w for i, w in enumerate(widths)])
                if after < now:
                    gain = ((now[0] - after[0]) / k, (now[1] - after[1]) / k, -j, k)
                    best = gain if best is None or gain[:2] > best[:2] else best
                    break
        if best is None:
            break
        widths[-best[2]] += best[3]
        spare -= best[3]
    return widths


def _line_width(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def _longest_piece(text: str) -> int:
    """The widest thing :func:`_wrapped` cannot break: a word, or a word's piece up to a break character."""
    return max((len(p) for word in text.split() for p in _PIECE.findall(word)), default=0)


def _wrapped(text: Text, width: int) -> Text:
    """``text`` broken into lines of at most ``width`` (see the module docstring), its styles kept."""
    lines = [text[start:end] for start, end in _line_spans(text.plain, width)]
    return Text("\n").join(lines) if lines else Text("")


def _line_spans(plain: str, width: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each line ``plain`` wraps into: greedy, between words; a word wider than
    ``width`` in pieces after ``( , = /``, a piece still wider cut at ``width``."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for paragraph in plain.split("\n"):
        pieces: list[tuple[int, int]] = []
        for word in re.finditer(r"\S+", paragraph):
            start, end = word.start() + offset, word.end() + offset
            if end - start <= width:
                pieces.append((start, end))
                continue
            for part in _PIECE.finditer(word.group()):
                s = start + part.start()
                while s < start + part.end():
                    e = min(s + width, start + part.end())
                    pieces.append((s, e))
                    s = e
        line: tuple[int, int] | None = None
        for s, e in pieces:
            if line is not None and e - line[0] <= width:
                line = (line[0], e)
                continue
            if line is not None:
                spans.append(line)
            line = (s, e)
        if line is not None:
            spans.append(line)
        offset += len(paragraph) + 1
    return spans


def _stacked(
    columns: Sequence[Column],
    cells: list[list[Text]],
    width: int,
    title: str | None,
    styles: list,
    show_header: bool,
) -> Text:
    """One block per row: its first cell, then ``header  value`` for every other column -- prose on a
    line of its own, wrapped under itself; short values side by side, as many as the width holds, aligned
    from row to row."""
    if not show_header:
        columns = [Column("", c.justify, c.wrap) for c in columns]
    key_width = max(len(c.header) for c in columns[1:])
    gap = 2 if key_width else 0
    short = [j for j, c in enumerate(columns) if j and not c.wrap]
    value_width = max((len(row[j].plain) for row in cells for j in short), default=0)
    slot = key_width + gap + value_width
    per_line = max(1, (width - _INDENT + _SLOT_GAP) // (slot + _SLOT_GAP))
    lines: list[Text] = []
    if title:
        lines += _wrapped(Text(title, style="italic"), width).split()
    for row, style in zip(cells, styles):
        head = row[0].copy()
        head.stylize(style or "bold")
        lines += _wrapped(head, width).split()
        j = 1
        while j < len(columns):
            if columns[j].wrap:  # prose: its own line(s)
                parts = _wrapped(row[j], max(width - _INDENT - key_width - gap, 10)).split() or [Text("")]
                for i, part in enumerate(parts):
                    lines.append(_key(columns[j].header if i == 0 else "", key_width, gap) + part)
                j += 1
                continue
            run = []  # consecutive short values: a grid of slots
            while j < len(columns) and not columns[j].wrap:
                run.append(j)
                j += 1
            for start in range(0, len(run), per_line):
                line = Text(" " * _INDENT)
                for n, k in enumerate(run[start : start + per_line]):
                    if n:
                        line.append(" " * _SLOT_GAP)
                    line.append_text(_key(columns[k].header, key_width, gap, indent=0))
                    line.append_text(row[k].copy())
                    line.append(" " * (value_width - len(row[k].plain)))
                line.rstrip()
                lines.append(line)
    return Text("\n").join(lines)


def _key(header: str, key_width: int, gap: int, indent: int = _INDENT) -> Text:
    return Text(" " * indent + header.ljust(key_width) + " " * gap, style="dim")
