"""Plain-text tables for the commands' human output."""

from __future__ import annotations

import click


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def print_table(headers: list[str], rows: list[list]) -> None:
    click.echo(format_table(headers, rows))


def display_width(text: str) -> int:
    """Terminal columns of `text`: wide characters (CJK) take two."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` terminal columns, broken at spaces (a longer word is cut)."""
    lines, line = [], ""
    for word in text.split():
        while display_width(word) > width:  # cut a word wider than a line, character by character
            cut = next(i for i in range(len(word), 0, -1) if display_width(word[:i]) <= width)
            lines += [line] if line else []
            lines.append(word[:cut])
            line, word = "", word[cut:]
        candidate = f"{line} {word}" if line else word
        if display_width(candidate) <= width:
            line = candidate
        else:
            lines.append(line)
            line = word
    return lines + [line] if line or not lines else lines


def format_wrapped_table(headers: list[str], rows: list[list], widths: list[int],
                         after: list[str] | None = None) -> str:
    """A table whose cells wrap at spaces to their column's width, with a rule between rows: for cells of
    prose. `after`: one line per row printed under it whole (a command to paste, say)."""

    def lines(row: list) -> list[str]:
        cells = [wrap(str(cell), width) for cell, width in zip(row, widths)]
        depth = max(len(cell) for cell in cells)
        return ["  ".join(cell[i] + " " * (width - display_width(cell[i])) if i < len(cell) else " " * width
                          for cell, width in zip(cells, widths)).rstrip() for i in range(depth)]

    rule = "  ".join("-" * width for width in widths)
    out = lines(headers) + [rule]
    for index, row in enumerate(rows):
        out += lines(row) + ([after[index]] if after else []) + [rule]
    return "\n".join(out)
