"""How rows reach the user (after a query, ``shards stats`` or ``shards sample``): a table, CSV or JSON.

Every value is data, printed as it is, never as markup or terminal commands:

- ``csv`` and ``json`` carry the exact text. They are written to stdout directly: ``click.echo`` strips
  ANSI-like sequences when stdout is not a terminal, which silently changed values.
- ``json`` is strict JSON (RFC 8259): a non-finite float becomes the string ``"NaN"``, ``"Infinity"`` or
  ``"-Infinity"`` (bare ``NaN`` is not JSON; ``null`` would hide a diverged loss).
- ``table`` is for eyes on a terminal: cells are rich ``Text`` (``[bold]`` stays ``[bold]``), and control
  characters (ESC, CR, BEL, bidi overrides, ...) are shown escaped (``\\x1b``), so data can neither recolour
  nor rewrite the terminal. A result too wide for the terminal is shown one record at a time
  (``column | value``, like psql's ``\\x``) instead of squeezing every column to ``…``.
- BLOB values (a reject's ``raw`` bytes) are shown as DuckDB shows them: printable ASCII as is, every other
  byte as ``\\xNN`` (``'...'::BLOB`` reads that text back).
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from collections.abc import Sequence
from decimal import Decimal
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TextIO

from rich.cells import cell_len

if TYPE_CHECKING:
    from rich.console import Console

MIN_READABLE_COLUMN_CELLS = 24
"""A table is drawn only if every column gets this many cells (or its whole width, when narrower)."""
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
# C0 controls but tab and newline, DEL, C1 controls (0x9b is CSI), bidi controls and line/paragraph separators.
_UNSAFE_FOR_TERMINAL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]")
# What JSON leaves raw that a terminal may still act on (json.dumps escapes C0 itself).
_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]")


class OutputFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


def emit_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], output_format: OutputFormat | str,
              out: TextIO | None = None, width: int | None = None) -> None:
    """Print ``rows`` (one value per column) to ``out`` (stdout) in ``output_format``.

    ``width`` is the terminal width in cells for the table format (default: rich's reading of the terminal,
    ``COLUMNS``, else 80).
    """
    out = out or sys.stdout
    output_format = OutputFormat(output_format)
    if output_format is OutputFormat.json:
        write_json(columns, rows, out)
    elif output_format is OutputFormat.csv:
        write_csv(columns, rows, out)
    else:
        write_table(columns, rows, out, width)


def write_json(columns: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    """A JSON array of objects, one per row; strict JSON (``allow_nan=False`` proves it)."""
    records = [dict(zip(columns, (json_value(value) for value in row), strict=True)) for row in rows]
    text = json.dumps(records, indent=2, ensure_ascii=False, allow_nan=False, default=_json_default)
    out.write(_UNSAFE_IN_JSON.sub(lambda match: f"\\u{ord(match.group()):04x}", text) + "\n")


def _json_default(value: Any) -> Any:
    """What ``json`` cannot write itself: a DECIMAL (DuckDB gives ``sum()`` of an integer column as HUGEINT, which
    Arrow carries as decimal128(38, 0)) as a JSON number when that is exact, else its text; anything else as text."""
    if isinstance(value, Decimal) and value.is_finite():
        if value == value.to_integral_value():
            return int(value)
        if Decimal(repr(float(value))) == value:
            return float(value)
    return str(value)


def write_csv(columns: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    """RFC 4180 CSV with a header; NULL is an empty field, a list or struct is its JSON text."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([[text_value(value, null="") for value in row] for row in rows])


def write_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO, width: int | None) -> None:
    """A rich table when every column fits ``width`` readably, else one block per record (:func:`write_records`).

    Off a terminal (a pipe, a file) with no ``width`` given, the table is drawn as wide as its values: a value
    is never wrapped (folded mid-word, it could not be read back or grepped); the choice of table or records
    still follows the terminal width (``COLUMNS``, else 80).
    """
    from rich.console import Console  # rich (~0.1 s): only when a table is printed

    console = Console(file=out, width=width, highlight=False, markup=False, emoji=False)
    cells = [[terminal_text(text_value(value)) for value in row] for row in rows]
    headers = [terminal_text(str(column)) for column in columns]
    if not table_fits(headers, cells, console.width):
        write_records(headers, cells, out)
    elif width is None and not console.is_terminal:
        console.width = natural_width(headers, cells)
        _print_rich_table(console, headers, cells, wrap=False)
    else:
        _print_rich_table(console, headers, cells)


def natural_width(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> int:
    """The cells a table needs to show every value on its own lines unwrapped, borders included."""
    return 1 + sum(3 + max([_widest_line(header), *(_widest_line(row[number]) for row in cells)])
                   for number, header in enumerate(headers))


def table_fits(headers: Sequence[str], cells: Sequence[Sequence[str]], width: int) -> bool:
    """Whether a table of these cells leaves every column readable (its width or
    :data:`MIN_READABLE_COLUMN_CELLS`, whichever is less) within ``width`` cells, borders included."""
    needed = 1 + 3 * len(headers)  # rich's box: a border left, then " value │" per column
    for number, header in enumerate(headers):
        widest = max([_widest_line(header), *(_widest_line(row[number]) for row in cells)])
        needed += min(widest, max(MIN_READABLE_COLUMN_CELLS, _widest_line(header)))
    return needed <= width


def _print_rich_table(console: Console, headers: Sequence[str], cells: Sequence[Sequence[str]],
                      wrap: bool = True) -> None:
    from rich.table import Column, Table  # rich: as above
    from rich.text import Text  # rich: as above

    # Text(), never markup: "[/version]" would crash the table and "[link=…]" become a terminal hyperlink.
    table = Table(*(Column(header=Text(header), overflow="fold", no_wrap=not wrap) for header in headers))
    for row in cells:
        table.add_row(*(Text(value) for value in row))
    console.print(table)


def write_records(headers: Sequence[str], cells: Sequence[Sequence[str]], out: TextIO) -> None:
    """One block per record: ``-[ row N ]-`` then ``column | value`` lines (continuation lines indented)."""
    name_cells = max((cell_len(header) for header in headers), default=0)
    for number, row in enumerate(cells, start=1):
        out.write(f"-[ row {number} ]{'-' * max(name_cells - 6, 4)}\n")
        for header, value in zip(headers, row, strict=True):
            first, *rest = value.split("\n")
            pad = " " * (name_cells - cell_len(header))
            out.write(f"{header}{pad} | {first}\n")
            out.writelines(f"{' ' * name_cells} | {line}\n" for line in rest)
    if not cells:
        out.write(f"(no rows; columns: {', '.join(headers)})\n")


def json_value(value: Any) -> Any:
    """``value`` as strict JSON data: non-finite floats as strings, bytes in DuckDB's BLOB text, nested too."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _NON_FINITE[value]
    if isinstance(value, bytes):
        return blob_text(value)
    if isinstance(value, dict):
        return {str(key): json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(item) for item in value]
    return value


def text_value(value: Any, null: str = "NULL") -> str:
    """One value as text for a CSV field or a table cell: a list or struct (or map) as its JSON text."""
    if value is None:
        return null
    if isinstance(value, list | tuple | dict):
        return json.dumps(json_value(value), ensure_ascii=False, allow_nan=False, default=str)
    converted = json_value(value)
    return converted if isinstance(converted, str) else str(converted)


def blob_text(value: bytes) -> str:
    """Bytes the way DuckDB casts a BLOB to text: printable ASCII but ``\\`` as is, every other byte ``\\xNN``."""
    return "".join(chr(byte) if 0x20 <= byte < 0x7F and byte != 0x5C else f"\\x{byte:02X}" for byte in value)


def terminal_text(text: str) -> str:
    """``text`` safe to show on a terminal: control and bidi characters escaped (``\\x1b``, ``\\u202e``)."""
    return _UNSAFE_FOR_TERMINAL.sub(lambda match: _escape(match.group()), text)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _widest_line(text: str) -> int:
    return max((cell_len(line) for line in text.split("\n")), default=0)
