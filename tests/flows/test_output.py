"""flows/cli/output.py and flows/cli/sample_view.py: the values printed are the data, in every format.

The CLI tests run the console script as a user does (stdout a pipe, ``COLUMNS=80``): that is where click's
ANSI stripping and rich's squeezing happened.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.schemas import DOCUMENTS_SCHEMA
from flows.cli.output import blob_text, emit_rows, table_fits, terminal_text
from flows.cli.sample_view import sample_block
from tests.conftest import build_query_run
from tests.flows.test_cli import TOKENMILL

MARKUP = "args[i] [/version] [bold]x :smile:"


def tokenmill(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([TOKENMILL, *args], capture_output=True, text=True, env=env, timeout=120)


def reject_constant(name: str) -> None:
    raise AssertionError(f"not JSON: bare {name}")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return build_query_run(tmp_path / "run")


# ---- through the CLI: one test per defect the issue saw ------------------------------------------


def test_csv_keeps_escape_sequences_in_values(run_dir: Path) -> None:
    result = tokenmill("query", str(run_dir), "SELECT chr(27) || '[31mred' AS d", "--format", "csv")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "d\n\x1b[31mred\n"


def test_table_escapes_control_characters_and_prints_markup_as_written(run_dir: Path) -> None:
    result = tokenmill("query", str(run_dir), f"SELECT chr(27) || '[31mred' || chr(8238) AS d, '{MARKUP}' AS m")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert "\\x1b[31mred\\u202e" in result.stdout
    assert MARKUP in result.stdout


def test_json_is_strict_json(run_dir: Path) -> None:
    sql = "SELECT 'nan'::DOUBLE AS a, 'inf'::DOUBLE AS b, ['-inf'::DOUBLE, 1.5] AS c, chr(27) AS d"
    result = tokenmill("query", str(run_dir), sql, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout, parse_constant=reject_constant) == [
        {"a": "NaN", "b": "Infinity", "c": ["-Infinity", 1.5], "d": "\x1b"}]


def test_a_wide_result_prints_one_record_per_block_without_squeezing(run_dir: Path) -> None:
    names = [f"metric_column_number_{number:02d}" for number in range(18)]
    sql = "SELECT " + ", ".join(f"step * {number} AS {name}" for number, name in enumerate(names)) + \
          " FROM train_metrics ORDER BY step"
    result = tokenmill("query", str(run_dir), sql)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    blocks = result.stdout.split("-[ row ")[1:]
    assert len(blocks) == 2  # train_metrics has steps 1 and 2
    for step, block in zip((1, 2), blocks, strict=True):
        for number, name in enumerate(names):
            assert f"{name} | {step * number}\n" in block


def test_a_piped_table_never_wraps_a_value(run_dir: Path) -> None:
    # Piped at COLUMNS=80, rich folded the path mid-word across two lines ("…/part-000" / "00.arrow").
    path, note = "shards/split=train/source=stdlib/part-00000.arrow", "a note of several words " * 3
    result = tokenmill("query", str(run_dir), f"SELECT '{path}' AS path, '{note}' AS note, 7 AS n")
    assert result.returncode == 0, result.stderr
    assert "-[ row " not in result.stdout  # every column fits readably: a table, as before
    [row] = [line for line in result.stdout.splitlines() if path in line]
    assert note.strip() in row and " 7 " in row


def test_shards_sample_is_one_compact_block_per_row(run_dir: Path) -> None:
    docs = pq.read_table(run_dir / "docs/part-00000.parquet").to_pylist()
    docs[2]["uri"] = f"lib/{MARKUP}.py"  # doc 3 fills the second row
    pq.write_table(pa.Table.from_pylist(docs, schema=DOCUMENTS_SCHEMA), run_dir / "docs/part-00000.parquet")
    result = tokenmill("shards", "sample", str(run_dir), "--n", "2", "--no-decode")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "shards/split=train/source=a/part-00000.arrow row 0 (train/a, 8 tokens)",
        "  doc 1 f.py at token 0",
        "  │ 0 1 2 3 4 5 6 7",
        "",
        "shards/split=train/source=a/part-00000.arrow row 1 (train/a, 8 tokens)",
        "  doc 1 f.py at token 0, continued from its token 8",
        f"  doc 3 lib/{MARKUP}.py at token 3",
        "  │ 8 9 10 11 12 13 14 15",
    ]


@pytest.mark.parametrize(("sql", "expected"), [
    ("SELEC 1", 'query failed: Parser Error: syntax error at or near "SELEC"'),
    ("SELECT * FROM documnets", 'Table with name documnets does not exist! Did you mean "documents"?'),
    ("SELECT " + "(" * 10_000 + "1" + ")" * 10_000, "Max expression depth limit of 1000 exceeded. Nest the"),
    ("SELECT " + "+".join(["1"] * 10_000), "Max expression depth limit of 1000 exceeded. Nest the"),
], ids=["syntax", "did-you-mean", "deep-parentheses", "long-sum"])
def test_a_mistake_in_the_sql_is_one_line_with_duckdbs_hint(run_dir: Path, sql: str, expected: str) -> None:
    result = tokenmill("query", str(run_dir), sql)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert "SET max_expression_depth" not in result.stderr  # the connection's settings are locked


def test_a_truncated_shard_breaks_only_the_queries_that_read_it(run_dir: Path) -> None:
    shard = run_dir / "shards/split=train/source=a/part-00000.arrow"
    shard.write_bytes(shard.read_bytes()[:500])
    documents = tokenmill("query", str(run_dir), "SELECT count(*) AS n FROM documents", "--format", "csv")
    assert (documents.returncode, documents.stdout) == (0, "n\n2\n"), documents.stderr
    sequences = tokenmill("query", str(run_dir), "SELECT count(*) FROM sequences")
    assert sequences.returncode == 2, sequences.stdout + sequences.stderr
    (line,) = sequences.stderr.strip().splitlines()
    assert str(shard) in line and f"`tokenmill shards verify {run_dir}`" in line


# ---- the rendering itself ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [b"", b"{oops", b"\x00\xff\\\x5cx'\"\n", bytes(range(256))])
def test_blob_text_is_what_duckdb_reads_back_as_the_same_bytes(value: bytes) -> None:
    assert duckdb.sql("SELECT $text::BLOB", params={"text": blob_text(value)}).fetchall() == [(value,)]


def test_terminal_text_leaves_text_tabs_and_newlines_alone() -> None:
    assert terminal_text("é\tx\ny [b]") == "é\tx\ny [b]"
    assert terminal_text("\r\x07\x9b\x7f") == "\\x0d\\x07\\x9b\\x7f"


def test_every_format_carries_nulls_nested_values_and_blobs() -> None:
    columns, rows = ["n", "l", "s", "b"], [[None, [1, None], {"k": "v"}, b"\xff"]]
    as_csv, as_json, as_table = io.StringIO(), io.StringIO(), io.StringIO()
    emit_rows(columns, rows, "csv", as_csv)
    emit_rows(columns, rows, "json", as_json)
    emit_rows(columns, rows, "table", as_table, width=80)
    assert as_csv.getvalue() == 'n,l,s,b\n,"[1, null]","{""k"": ""v""}",\\xFF\n'
    assert json.loads(as_json.getvalue()) == [{"n": None, "l": [1, None], "s": {"k": "v"}, "b": "\\xFF"}]
    assert "NULL" in as_table.getvalue() and '{"k": "v"}' in as_table.getvalue()


def test_json_escapes_what_a_terminal_could_act_on() -> None:
    out = io.StringIO()
    emit_rows(["t"], [["\x9b31m\u202eé"]], "json", out)
    assert "\x9b" not in out.getvalue() and "\u202e" not in out.getvalue() and "é" in out.getvalue()
    assert json.loads(out.getvalue()) == [{"t": "\x9b31m\u202eé"}]


def test_a_table_is_drawn_only_when_every_column_stays_readable() -> None:
    assert table_fits(["a", "b"], [["1", "x" * 500]], 80)  # a long text wraps in a readable column
    assert not table_fits([f"column_{n}" for n in range(18)], [["1.0"] * 18], 80)
    out = io.StringIO()
    emit_rows(["a_long_column_name", "b"], [], "table", out, width=20)
    assert out.getvalue() == "(no rows; columns: a_long_column_name, b)\n"


def test_a_sample_block_escapes_what_it_shows() -> None:
    row = {"shard_path": "shards/split=val/source=s/part-00000.arrow", "row": 4, "split": "val", "source": "s",
           "num_tokens": 3, "num_pad_tokens": 1, "first_doc_offset": 0, "doc_ids": [7], "doc_starts": [0],
           "uris": [None], "text": "a\x1b[2J\nb<|pad|>×1"}
    assert sample_block(row) == ["shards/split=val/source=s/part-00000.arrow row 4 (val/s, 3 tokens + 1 pad)",
                                 "  doc 7 (uri unknown) at token 0", "  │ a\\x1b[2J", "  │ b<|pad|>×1"]


def test_json_writes_decimal_sums_as_numbers_when_exact() -> None:
    """``sum()`` of an integer column is HUGEINT in DuckDB, a Decimal in Python: a number in JSON, not a string;
    a decimal a float cannot hold exactly stays text rather than change."""
    table = duckdb.sql("SELECT sum(x) AS total, sum(x)::DECIMAL(18, 2) AS money, 0.25::DECIMAL(4, 2) AS quarter, "
                      "0.1::DECIMAL(38, 37) + 1e-37::DECIMAL(38, 37) AS fine FROM range(4) t(x)").to_arrow_table()
    out = io.StringIO()
    emit_rows(table.column_names, [list(row.values()) for row in table.to_pylist()], "json", out)
    assert json.loads(out.getvalue()) == [{"total": 6, "money": 6, "quarter": 0.25,
                                           "fine": "0.1000000000000000000000000000000000001"}]
