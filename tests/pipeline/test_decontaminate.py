"""pipeline/dedupe/decontaminate.py on real stdlib files with planted val and eval quotations, against a pure-Python
oracle."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from core.documents import CONTAMINATED_FILE, DUPLICATES_FILE, iter_documents
from core.errors import ConfigError
from core.rundir import RunPaths
from core.schemas import REJECTS_SCHEMA
from pipeline.config import DecontaminateConfig, DedupeConfig
from pipeline.dedupe.decontaminate import decontaminate_documents
from pipeline.dedupe.stage import dedupe_documents
from pipeline.filters.normalisation import normalise_text
from pipeline.filters.screen import REJECT_REASONS, content_hash, split_for
from pipeline.ingest.stage import ingest_part, plan_ingest

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VAL_FRACTION = 0.2
NGRAM = 13
EVAL_PASSAGE = ("Grace Hopper found a moth trapped in relay seventy of the Mark Two and taped it into the "
                "logbook as the first actual case of a bug being found")


def letters(number: int) -> str:
    """``number`` in base 26 with letters: distinct words that stay distinct when near dedupe reads digits as 0."""
    digits = ""
    while True:
        number, digit = divmod(number, 26)
        digits = chr(97 + digit) + digits
        if not number:
            return digits


def split_of(text: str) -> str:
    return split_for(content_hash(normalise_text(text)), VAL_FRACTION)


def ngrams(text: str) -> set[tuple[bytes, ...]]:
    words = text.encode("utf-8").lower().split()
    return {tuple(words[i : i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def train_text(body: str, split: str = "train") -> str:
    """``body`` with a filler line chosen so that the text lands in ``split``."""
    for attempt in range(1000):
        text = f"# planted file, variant {attempt}\n{body}\n"
        if split_of(text) == split:
            return text
    raise AssertionError(f"no {split} variant found")


@pytest.fixture
def corpus(tmp_path: Path) -> dict:
    folder = tmp_path / "corpus"
    folder.mkdir()
    chosen = [p for p in sorted(STDLIB.glob("*.py")) if 2_000 < p.stat().st_size < 40_000][:40]
    for path in chosen:
        shutil.copy(path, folder / path.name)
    val_file = next(p for p in chosen if split_of(p.read_text(encoding="utf-8")) == "val")
    words = val_file.read_text(encoding="utf-8").split()
    passage = " ".join(words[len(words) // 2 : len(words) // 2 + NGRAM])
    (folder / "zz_quotes_val.py").write_text(train_text(f"x = 1\n{passage}\ny = 2"), encoding="utf-8")
    near_miss = " ".join(passage.split()[:-1])  # 12 of the 13 words
    (folder / "zz_near_miss.py").write_text(train_text(f"z = 3\n{near_miss}\nw = 4"), encoding="utf-8")
    quoted = " ".join(EVAL_PASSAGE.split()[3:16]).upper()  # case differs: words are compared lower-cased
    (folder / "zz_quotes_eval.py").write_text(train_text(f'"""\n{quoted}\n"""'), encoding="utf-8")
    evals = tmp_path / "evals"
    evals.mkdir()
    records = [{"text": "an unrelated evaluation question about sorting lists"}, {"text": EVAL_PASSAGE}]
    (evals / "bugs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    manifest = tmp_path / "corpus.yaml"
    manifest.write_text(yaml.safe_dump({"name": "c", "sources": [{"name": "lib", "path": "corpus", "format": "text"}]}))
    return {"manifest": manifest, "val_file": val_file.name, "passage": passage, "folder": folder}


def prepare(corpus: dict, paths: RunPaths) -> None:
    for part in plan_ingest([corpus["manifest"]], paths, 96 * 1024):
        ingest_part(part, VAL_FRACTION, paths)
    dedupe_documents(paths, DedupeConfig())


def documents_by_uri(paths: RunPaths) -> dict[str, dict]:
    return {row["uri"]: row for part in sorted(paths.docs.glob("part-*.parquet"))
            for row in pq.read_table(part).to_pylist()}


def expected_contaminated(paths: RunPaths, eval_texts: list[str]) -> set[str]:
    """The oracle: kept train documents sharing a 13-word n-gram with a kept val document or an eval text."""
    removed = set(pq.read_table(paths.dedupe / DUPLICATES_FILE).column("doc_id").to_pylist())
    kept = [row for row in documents_by_uri(paths).values() if row["doc_id"] not in removed]
    reference = set().union(*(ngrams(row["text"]) for row in kept if row["split"] == "val"),
                            *(ngrams(text) for text in eval_texts))
    return {row["uri"] for row in kept if row["split"] == "train" and ngrams(row["text"]) & reference}


def config(**overrides: object) -> DecontaminateConfig:
    return DecontaminateConfig(enabled=True, eval_files=["evals/bugs.jsonl"], **overrides)


def test_train_documents_quoting_val_or_eval_are_removed(corpus: dict, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    summary = decontaminate_documents(paths, config(), base_dir=tmp_path)
    rows = {row["uri"]: row for row in pq.read_table(paths.rejects / CONTAMINATED_FILE).to_pylist()}
    assert set(rows) == expected_contaminated(paths, [EVAL_PASSAGE])
    assert {"zz_quotes_val.py", "zz_quotes_eval.py"} <= set(rows) and "zz_near_miss.py" not in rows
    assert summary["num_contaminated"] == len(rows) and summary["enabled"]
    docs = documents_by_uri(paths)
    val_id = docs[corpus["val_file"]]["doc_id"]
    assert rows["zz_quotes_val.py"]["detail"] == (f"shares the 13-word n-gram {corpus['passage']!r} "
                                                  f"with val doc_id {val_id}")
    eval_detail = rows["zz_quotes_eval.py"]["detail"]
    assert eval_detail.endswith("with eval file bugs.jsonl:2")
    assert " ".join(EVAL_PASSAGE.split()[3:16]).upper() in eval_detail
    for uri, row in rows.items():
        assert row["reason"] == "contaminated" and row["reason"] in REJECT_REASONS
        assert row["raw"] == docs[uri]["text"].encode("utf-8") and docs[uri]["split"] == "train"
    assert pq.read_schema(paths.rejects / CONTAMINATED_FILE).equals(REJECTS_SCHEMA)
    kept = {row["uri"] for batch in iter_documents(paths, columns=["uri"]) for row in batch.to_pylist()}
    duplicates = set(pq.read_table(paths.dedupe / DUPLICATES_FILE).column("uri").to_pylist())
    part_rejects = {row["uri"] for part in sorted(paths.rejects.glob("part-*.parquet"))
                    for row in pq.read_table(part).to_pylist()}
    every_file = sorted(p.name for p in corpus["folder"].iterdir())
    assert sorted([*kept, *duplicates, *part_rejects, *rows]) == every_file  # each record exactly once


def test_rerun_refresh_and_disable(corpus: dict, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    first = decontaminate_documents(paths, config(), base_dir=tmp_path)
    output = paths.rejects / CONTAMINATED_FILE
    stamp = output.stat().st_mtime_ns
    assert decontaminate_documents(paths, config(), base_dir=tmp_path) == {**first, "skipped": True}
    assert output.stat().st_mtime_ns == stamp  # nothing redone
    before = {row["uri"] for row in pq.read_table(output).to_pylist()}
    (corpus["folder"] / "zzz_new_quote.py").write_text(train_text(f"v = 5\n{corpus['passage']}"), encoding="utf-8")
    prepare(corpus, paths)
    refreshed = decontaminate_documents(paths, config(), base_dir=tmp_path)
    after = {row["uri"] for row in pq.read_table(output).to_pylist()}
    assert after == before | {"zzz_new_quote.py"}
    assert refreshed["num_train_checked"] == 1  # only the new part's train document was checked
    num_kept = sum(batch.num_rows for batch in iter_documents(paths))
    assert decontaminate_documents(paths, DecontaminateConfig())["enabled"] is False
    assert not output.exists()
    assert sum(batch.num_rows for batch in iter_documents(paths)) == num_kept + len(after)


def test_refresh_rejects_new_val_documents_quoting_train_documents_packed_earlier(corpus: dict,
                                                                                  tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    first = decontaminate_documents(paths, config(), base_dir=tmp_path)
    assert first["contaminated_by_reference"]["earlier_train"] == 0
    docs, contaminated = documents_by_uri(paths), {row["uri"] for row in pq.read_table(
        paths.rejects / CONTAMINATED_FILE).to_pylist()}
    trained = next(row for uri, row in sorted(docs.items()) if row["split"] == "train" and uri not in contaminated
                   and not uri.startswith("zz"))
    words = trained["text"].split()
    quote = " ".join(words[len(words) // 2 : len(words) // 2 + NGRAM])
    not_trained = " ".join(EVAL_PASSAGE.split()[3:16]).upper()  # only in zz_quotes_eval.py, rejected above
    # Distinct tails: without them the two quoting files are near-duplicates (on normalised words) of each other.
    tail_a, tail_b, tail_c = (" ".join(f"{prefix}{chr(97 + i)}" for i in range(26)) for prefix in ("alpha", "beta",
                                                                                                  "gamma"))
    new_files = {"zzz_val_quote_a.py": f"a = 1\n{quote}\n{tail_a}", "zzz_val_quote_b.py": f"{quote}\nb = 2\n{tail_b}",
                 "zzz_val_near_miss.py": " ".join(quote.split()[:-1]),
                 "zzz_val_untrained.py": f"{not_trained}\n{tail_c}"}
    for name, body in new_files.items():
        (corpus["folder"] / name).write_text(train_text(body, split="val"), encoding="utf-8")
    prepare(corpus, paths)
    refreshed = decontaminate_documents(paths, config(), base_dir=tmp_path)
    rows = {row["uri"]: row for row in pq.read_table(paths.rejects / CONTAMINATED_FILE).to_pylist()}
    assert set(rows) == contaminated | {"zzz_val_quote_a.py", "zzz_val_quote_b.py"}
    assert refreshed["contaminated_by_reference"]["earlier_train"] == 2
    assert rows["zzz_val_quote_a.py"]["detail"] == (f"shares the 13-word n-gram {quote!r} with train doc_id "
                                                    f"{trained['doc_id']}, packed earlier")
    kept_val = {row["uri"] for batch in iter_documents(paths, split="val", columns=["uri"])
                for row in batch.to_pylist()}
    assert {"zzz_val_near_miss.py", "zzz_val_untrained.py"} <= kept_val
    assert not {"zzz_val_quote_a.py", "zzz_val_quote_b.py"} & kept_val
    again = decontaminate_documents(paths, config(), base_dir=tmp_path)
    assert again == {**refreshed, "skipped": True}  # decisions stand


def test_eval_only_and_missing_eval_file(corpus: dict, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    summary = decontaminate_documents(paths, config(against_val=False), base_dir=tmp_path)
    rows = pq.read_table(paths.rejects / CONTAMINATED_FILE).column("uri").to_pylist()
    assert rows == ["zz_quotes_eval.py"]
    assert summary["contaminated_by_reference"] == {"val": 0, "eval": 1, "eval_task": 0, "earlier_train": 0}
    with pytest.raises(ConfigError, match=r"eval_files: evals/missing\.jsonl does not exist"):
        decontaminate_documents(paths, DecontaminateConfig(enabled=True, eval_files=["evals/missing.jsonl"]),
                                base_dir=tmp_path)


def test_boilerplate_ngrams_shared_by_many_train_documents_do_not_contaminate(corpus: dict, tmp_path: Path) -> None:
    header = ("# This file is part of the example project and is distributed under the terms of the example "
              "licence, version two, without any warranty of any kind, express or implied.")
    folder = corpus["folder"]
    (folder / "zz_header_val.py").write_text(train_text(f"{header}\nvalue = 'val'", split="val"), encoding="utf-8")
    for number in range(4):  # distinct bodies, so dedupe keeps all four
        body = " ".join(f"word{letters((number * 7919 + i * 104729) % 1000003)}" for i in range(200))
        (folder / f"zz_header_{number}.py").write_text(train_text(f"{header}\n{body}"), encoding="utf-8")
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    plain = decontaminate_documents(paths, config(), base_dir=tmp_path)
    flagged = set(pq.read_table(paths.rejects / CONTAMINATED_FILE).column("uri").to_pylist())
    assert {f"zz_header_{number}.py" for number in range(4)} <= flagged
    summary = decontaminate_documents(paths, config(max_ngram_train_docs=3), base_dir=tmp_path)
    kept_flagged = set(pq.read_table(paths.rejects / CONTAMINATED_FILE).column("uri").to_pylist())
    assert not any(uri.startswith("zz_header_") for uri in kept_flagged)
    assert {"zz_quotes_val.py", "zz_quotes_eval.py"} <= kept_flagged < flagged
    assert summary["num_boilerplate_ngrams"] > 0 == plain["num_boilerplate_ngrams"]


def test_refresh_keeps_new_val_documents_that_share_only_boilerplate_with_earlier_train(corpus: dict,
                                                                                        tmp_path: Path) -> None:
    header = ("# This file is part of the example project and is distributed under the terms of the example "
              "licence, version two, without any warranty of any kind, express or implied.")
    bodies = [" ".join(f"word{letters((number * 7919 + i * 104729) % 1000003)}" for i in range(200))
              for number in range(4)]
    for number, body in enumerate(bodies):  # distinct bodies, so dedupe keeps all four
        (corpus["folder"] / f"zz_header_{number}.py").write_text(train_text(f"{header}\n{body}"), encoding="utf-8")
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    decontaminate_documents(paths, config(max_ngram_train_docs=3), base_dir=tmp_path)
    quote = " ".join(bodies[2].split()[50 : 50 + NGRAM])
    new_files = {"zzz_val_header.py": f"{header}\nvalue = 'val'", "zzz_val_body_quote.py": f"{header}\n{quote}"}
    for name, body in new_files.items():
        (corpus["folder"] / name).write_text(train_text(body, split="val"), encoding="utf-8")
    prepare(corpus, paths)
    refreshed = decontaminate_documents(paths, config(max_ngram_train_docs=3), base_dir=tmp_path)
    rows = {row["uri"]: row for row in pq.read_table(paths.rejects / CONTAMINATED_FILE).to_pylist()}
    assert "zzz_val_header.py" not in rows  # the header is in 4 train documents > 3: boilerplate
    assert rows["zzz_val_body_quote.py"]["detail"].endswith(
        f"with train doc_id {documents_by_uri(paths)['zz_header_2.py']['doc_id']}, packed earlier")
    assert refreshed["contaminated_by_reference"]["earlier_train"] == 1


def test_evaluation_task_items_decontaminate_even_when_the_stage_is_off(corpus: dict, tmp_path: Path) -> None:
    """The recipe's eval tasks (their texts in eval/texts/) are always checked against, and counted per task."""
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    task_texts = paths.eval_text("bug_stories")
    paths.write_text(task_texts, "".join(json.dumps({"text": text}) + "\n" for text in ("a short item", EVAL_PASSAGE)))
    summary = decontaminate_documents(paths, DecontaminateConfig(), base_dir=tmp_path,  # enabled: false
                                      eval_tasks={"bug_stories": task_texts})
    rows = {row["uri"]: row for row in pq.read_table(paths.rejects / CONTAMINATED_FILE).to_pylist()}
    assert set(rows) == {"zz_quotes_eval.py"}, "only the task was checked: val quotations stay (stage is off)"
    assert rows["zz_quotes_eval.py"]["detail"].endswith("with eval task bug_stories item bug_stories.jsonl:2")
    assert summary["contaminated_by_task"] == {"bug_stories": 1}
    assert summary["contaminated_by_reference"]["eval_task"] == 1
    # With the stage on, a document quoting a val document is still counted for val, not for a task.
    summary = decontaminate_documents(paths, config(), base_dir=tmp_path, eval_tasks={"bug_stories": task_texts})
    assert summary["contaminated_by_task"] == {"bug_stories": 1} and summary["contaminated_by_reference"]["val"] >= 1


def test_the_summary_says_enabled_as_the_recipe_does_and_counts_task_removals_apart(corpus: dict,
                                                                                     tmp_path: Path) -> None:
    """With ``enabled: false`` the evaluation tasks are still checked: the summary says ``enabled: false`` (the
    recipe's setting) and counts the task removals as ``eval_tasks``, on a run and on its skipped re-run."""
    paths = RunPaths(tmp_path / "run")
    prepare(corpus, paths)
    task_texts = paths.eval_text("bug_stories")
    paths.write_text(task_texts, json.dumps({"text": EVAL_PASSAGE}) + "\n")
    for _ in range(2):  # the second call is skipped and returns the recorded summary
        off = decontaminate_documents(paths, DecontaminateConfig(), base_dir=tmp_path,
                                      eval_tasks={"bug_stories": task_texts})
        assert (off["enabled"], off["eval_tasks"], off["num_contaminated"]) == (False, 1, 1), off
    on = decontaminate_documents(paths, config(), base_dir=tmp_path, eval_tasks={"bug_stories": task_texts})
    assert on["enabled"] is True and on["eval_tasks"] == 1 and on["num_contaminated"] > 1, on


def test_the_recipe_reference_says_the_tasks_are_checked_whatever_enabled_says() -> None:
    import ast
    import inspect

    import pipeline.config

    body = next(node for node in ast.parse(inspect.getsource(pipeline.config)).body
                if isinstance(node, ast.ClassDef) and node.name == "DecontaminateConfig").body
    field = next(i for i, node in enumerate(body) if isinstance(node, ast.AnnAssign) and node.target.id == "enabled")
    docstring = body[field + 1].value.value
    section = (Path(__file__).parents[2] / "docs" / "recipe.md").read_text().split("## `dedupe.decontaminate`")[1]
    row = next(line for line in section.splitlines() if line.startswith("| `enabled` |"))
    for text in (docstring, row):
        assert "always checked" in text and "eval_tasks" in text, text
