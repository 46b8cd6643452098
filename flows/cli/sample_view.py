"""How ``tokenmill shards sample`` shows sampled packed rows on a terminal: one compact block per row.

A block is a heading line (where the row lies and how full it is), one line per document that fills the row
(doc_id, uri, the token it starts at) and the decoded text (or the token ids), each line behind ``│``.
Every value is data: shown through :func:`flows.cli.output.terminal_text`, never as markup or terminal commands.
``--format csv|json`` gives every field of the rows instead (:func:`flows.cli.output.emit_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from flows.cli.output import terminal_text


def write_sample_rows(rows: Sequence[Mapping[str, Any]], out: TextIO) -> None:
    """One block per row of :func:`tokenization.sample.sample_rows`, blocks separated by a blank line."""
    for number, row in enumerate(rows):
        if number:
            out.write("\n")
        out.writelines(f"{line}\n" for line in sample_block(row))


def sample_block(row: Mapping[str, Any]) -> list[str]:
    """The lines of one sampled row's block (without line ends)."""
    pad = f" + {row['num_pad_tokens']} pad" if row["num_pad_tokens"] else ""
    lines = [terminal_text(f"{row['shard_path']} row {row['row']} ({row['split']}/{row['source']}, "
                           f"{row['num_tokens']} tokens{pad})")]
    for position, (doc_id, start, uri) in enumerate(zip(row["doc_ids"], row["doc_starts"], row["uris"],
                                                       strict=True)):
        continued = (f", continued from its token {row['first_doc_offset']}"
                     if position == 0 and row["first_doc_offset"] else "")
        lines.append(terminal_text(f"  doc {doc_id} {uri if uri is not None else '(uri unknown)'} "
                                   f"at token {start}{continued}"))
    body = row["text"] if "text" in row else " ".join(str(token) for token in row["input_ids"])
    lines.extend(f"  │ {terminal_text(line)}" for line in body.split("\n"))
    return lines
