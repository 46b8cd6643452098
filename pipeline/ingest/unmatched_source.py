"""Planning ingest: a source whose path, glob and exclude match no file is an error before any work starts.

A glob typo (``*.jsnol``) used to make its source vanish: ``prepare`` exited 0 and the source was absent from
every view. :func:`pipeline.ingest.stage.list_source_files`, the one place a source becomes files, asks
:func:`matched_before` and raises :func:`unmatched_source_error` instead. A nightly refresh that finds no *new*
file is not this: its source matched files before (``docs/plan.json`` lists them), so it plans nothing, quietly.
"""

from __future__ import annotations

import difflib
import os
from collections import Counter
from pathlib import Path, PurePosixPath

from core.errors import ManifestError
from core.files.atomic import read_json
from core.rundir import RunPaths
from pipeline.manifest import SourceConfig

MAX_FILES_LOOKED_AT = 10_000
"""Files whose extensions the message counts (a walk of a huge folder stops here: it is only a hint)."""
MAX_EXTENSIONS_NAMED = 5
COMPRESSION_SUFFIXES = (".gz", ".zst", ".bz2", ".xz")


def matched_before(run_dir: Path | None, source_name: str) -> bool:
    """Whether the run's ingest plan already lists files of ``source_name`` (a refresh, not a typo)."""
    plan = RunPaths(run_dir).ingest_plan if run_dir is not None else None
    if plan is None or not plan.is_file():
        return False
    try:
        files = read_json(plan).get("files", {}).get(source_name)
    except (OSError, ValueError, AttributeError):
        return False  # the planner reads the plan next and names what is wrong with it
    return bool(files)


def unmatched_source_error(source: SourceConfig, manifest_path: Path, resolved: str,
                           names: list[str]) -> ManifestError:
    """The one line for a source that matches no file under ``resolved``; ``names`` are the files (relative
    paths) that are there, unmatched, for a hint at the extensions that do exist."""
    excluding = f" minus exclude {source.exclude!r}" if source.exclude else ""
    return ManifestError(
        f"{manifest_path}: sources[{source.name}] matches no file: glob {source.glob!r}{excluding} under "
        f"{resolved}; {_hint(source, names)}fix the glob, exclude or path in the manifest, or remove the source "
        "(nothing was ingested)."
    )


def local_names(folder: Path) -> list[str]:
    """Relative paths of (up to MAX_FILES_LOOKED_AT) files under ``folder``, for :func:`unmatched_source_error`."""
    if not folder.is_dir():
        return []
    names: list[str] = []
    for root, _, files in os.walk(folder):
        prefix = Path(root).relative_to(folder).as_posix()
        names.extend(name if prefix == "." else f"{prefix}/{name}" for name in files)
        if len(names) >= MAX_FILES_LOOKED_AT:
            break
    return sorted(names[:MAX_FILES_LOOKED_AT])


def _hint(source: SourceConfig, names: list[str]) -> str:
    """What the folder holds instead (``it holds .jsonl (12), .txt (3)``) and the nearest extension to the glob's."""
    if not names:
        return "there is no file there at all; "
    counts = Counter(_extension(name) for name in names)
    most = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:MAX_EXTENSIONS_NAMED]
    listed = ", ".join(f"{extension or 'no extension'} ({count})" for extension, count in most)
    hint = f"the files there end in {listed}; "
    wanted = _extension(source.glob)
    near = difflib.get_close_matches(wanted, [ext for ext in counts if ext], n=1, cutoff=0.6) if wanted else []
    if near and near[0] != wanted:
        hint += f"did you mean glob {source.glob[: -len(wanted)] + near[0]!r}? "
    return hint


def _extension(name: str) -> str:
    """``.py`` of ``a/b.c.py``, ``.jsonl.gz`` of ``b.jsonl.gz`` (a compressed file's format shows), of a glob too."""
    suffixes = PurePosixPath(name).suffixes
    if len(suffixes) > 1 and suffixes[-1] in COMPRESSION_SUFFIXES:
        return "".join(suffixes[-2:])
    return suffixes[-1] if suffixes else ""
