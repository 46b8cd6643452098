"""docs/querying.md "SQL cookbook" and "Reading a shard without tokenmill": every snippet runs on a real, trained
small run (the README's sections, moved there).

The run is built once per module the way the flow builds it (pure stage functions, no Prefect): a slice of
the standard library with a planted exact copy, a near copy, a too-short file and a binary file, then a few
training steps on a tiny model, so every view (rejects, duplicates, metrics) has rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from accelerate.state import AcceleratorState, GradientState

from core.rundir import RunPaths
from flows.recipe import load_recipe, manifest_paths, record_recipe
from flows.run_sql import run_query
from pipeline.dedupe.summary import dedupe_stage
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.sql.query import near_duplicate_pairs, token_mix
from tests.flows.conftest import write_small_recipe
from tokenization.stage import pack_split_source, write_index
from tokenization.train_tokenizer import prepare_tokenizer

QUERYING = Path(__file__).resolve().parents[1] / "docs" / "querying.md"
SOURCE = "stdlib"
"""The source name write_small_recipe gives the corpus (the README snippets read ``source=stdlib`` shards)."""


SHORT_MODULES = {
    "json/short_alpha.py": "def alpha(values):\n    return sorted(values, reverse=True)\n",
    "json/short_beta.py": "import math\n\nRADIUS = 3.5\nAREA = math.pi * RADIUS ** 2\n",
    "json/short_gamma.py": "class Point:\n    x: int = 0\n    y: int = 0\n",
    "json/short_delta.py": "print('hello from a tiny module', 42)\n",
}
"""Documents shorter than a row, so rows hold several documents each."""


def plant_corpus_faults(corpus: Path) -> None:
    """An exact copy, a near copy (every 100th word edited), a too-short file, a binary file, short modules."""
    for relpath, text in SHORT_MODULES.items():
        (corpus / relpath).write_text(text, encoding="utf-8")
    original = (corpus / "json" / "decoder.py").read_text(encoding="utf-8")
    (corpus / "json" / "decoder_copy.py").write_text(original, encoding="utf-8")
    counter = iter(range(10**9))
    edited = re.sub(r"\S+", lambda m: "EDITED" if next(counter) % 100 == 99 else m.group(0),
                    (corpus / "json" / "encoder.py").read_text(encoding="utf-8"))
    (corpus / "json" / "encoder_edited.py").write_text(edited, encoding="utf-8")
    (corpus / "json" / "tiny.py").write_text("x = 1\n", encoding="utf-8")
    (corpus / "json" / "blob.py").write_bytes(b"\x00\x01\x02binary\x00\x00" * 64)


def build_small_run(root: Path, *, train_steps: int = 0, packages: tuple[str, ...] = ("json", "email")) -> Path:
    """A real run dir under ``root/run``: documents, rejects, duplicates, tokenizer, shards, and (when
    ``train_steps``) checkpoints and metrics from that many steps of a tiny model. Returns the run dir."""
    recipe = write_small_recipe(root, max_steps=max(train_steps, 1), packages=packages)
    if train_steps:  # the cookbook's per-source loss curve reads row_losses
        edited = yaml.safe_load(recipe.read_text())
        recipe.write_text(yaml.safe_dump({**edited, "train": {**edited["train"], "log_row_losses": True}}))
    plant_corpus_faults(root / "corpus")
    loaded, base = load_recipe(recipe)
    paths = RunPaths(root / "run")
    paths.root.mkdir(parents=True)
    record_recipe(loaded, base, paths.root)
    for part in plan_ingest(manifest_paths(loaded, base), paths, loaded.data.part_size_bytes):
        ingest_part(part, loaded.data.val_fraction, paths)
    dedupe_stage(paths, loaded.dedupe)
    prepare_tokenizer(paths, loaded.tokenizer, None)
    for split in ("train", "val"):
        pack_split_source(paths, split, SOURCE, loaded.pack)
    write_index(paths)
    if train_steps:
        from trainer.train import train

        AcceleratorState._reset_state(reset_partial_state=True)  # other tests may have built an Accelerator
        GradientState._reset_state()
        train(paths.root)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        from trainer.eval.checkpoint import evaluate_checkpoint

        evaluate_checkpoint(paths.root, train_steps, score=True, export=False)  # the eval_results view has rows
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return paths.root


def readme_section(heading: str) -> str:
    """The text of docs/querying.md's section ``## heading`` up to the next ``## `` heading (or the end)."""
    text = QUERYING.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/querying.md has no section '## {heading}'"
    return match.group(1)


def fenced_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", section, re.S | re.M)


COOKBOOK = readme_section("SQL cookbook")
QUERIES = fenced_blocks(COOKBOOK, "sql")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield build_small_run(tmp_path_factory.mktemp("readme"), train_steps=4)


def test_cookbook_has_at_least_eight_questions_each_with_one_query() -> None:
    assert len(QUERIES) >= 8
    questions = re.findall(r"^\*\*Question\.\*\* .+\n\n```sql\n", COOKBOOK, re.M)
    assert len(questions) == len(QUERIES), "every ```sql block follows its own one-line **Question.**"


@pytest.mark.parametrize("sql", QUERIES, ids=[f"query{number}" for number in range(1, len(QUERIES) + 1)])
def test_cookbook_query_returns_rows_on_a_real_run(trained_run: Path, sql: str) -> None:
    table = run_query(trained_run, sql)
    assert table.num_rows >= 1, sql


def test_the_planted_faults_reach_the_views(trained_run: Path) -> None:
    removed = run_query(trained_run, QUERIES[3]).to_pylist()  # "What was removed, and why"
    assert {(row["removed_as"], row["why"]) for row in removed} >= {("duplicate", "exact"), ("duplicate", "near")}
    rejected = run_query(trained_run, "SELECT uri FROM rejects").column("uri").to_pylist()
    assert {"json/tiny.py", "json/blob.py"} <= set(rejected)
    near = run_query(trained_run, QUERIES[4]).to_pylist()  # near-duplicate pairs with both uris
    # Which of the two is kept follows dedupe's rule (the earliest by part, then row, in the order ingest wrote
    # the rows: each split in row groups of its own), not the file names: the pair is found either way round.
    assert [{row["removed_uri"], row["kept_uri"]} for row in near] == [{"json/encoder_edited.py", "json/encoder.py"}]


def test_reading_a_shard_without_tokenmill_snippet_runs(trained_run: Path, capsys: pytest.CaptureFixture) -> None:
    (snippet,) = fenced_blocks(readme_section("Reading a shard without tokenmill"), "python")
    assert "tokenmill" not in snippet and "pipeline" not in snippet
    namespace: dict = {"run_dir": str(trained_run)}
    exec(compile(snippet, "README.md", "exec"), namespace)
    tokens = namespace["tokens"]
    assert tokens.ndim == 2 and tokens.shape[1] == 64 and not tokens.flags.writeable
    assert str(tokens.shape) in capsys.readouterr().out


def test_named_queries_token_mix_and_near_duplicate_pairs(trained_run: Path) -> None:
    mix = {row["split"]: row for row in token_mix(trained_run)}
    assert set(mix) == {"train", "val"}
    assert sum(row["num_tokens"] for row in mix.values()) == run_query(
        trained_run, "SELECT sum(num_tokens)::BIGINT AS n FROM shards").column("n")[0].as_py()
    assert mix["train"]["pct_of_split_tokens"] == 100.0 and mix["train"]["tokens_per_char"] > 0
    (pair,) = near_duplicate_pairs(trained_run)
    assert {pair["removed_uri"], pair["kept_uri"]} == {"json/encoder_edited.py", "json/encoder.py"}
    assert 0.8 <= pair["similarity"] < 1.0


def test_a_sampled_row_is_found_by_shard_path_and_row_in_shard(trained_run: Path) -> None:
    """docs/querying.md: "A row is pinned down by shard_path and row_in_shard; tokenmill shards sample prints both"."""
    from tokenization.sample import sample_rows

    for row in sample_rows(trained_run, 5, seed=3):
        sql = (f"SELECT doc_ids, first_doc_offset, num_tokens FROM sequences "
               f"WHERE shard_path = '{row['shard_path']}' AND row_in_shard = {row['row']}")
        found = run_query(trained_run, sql).to_pylist()
        assert found == [{"doc_ids": row["doc_ids"], "first_doc_offset": row["first_doc_offset"],
                          "num_tokens": row["num_tokens"]}]
