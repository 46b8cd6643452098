"""Encode + pack stage of the data path: kept documents of one (split, source) -> Arrow token shards.

Each ``shards/split=<split>/source=<source>/`` folder holds ``part-NNNNN.arrow`` shards and a
``state.json`` (stage state) that records which document parts are packed, and by which call; the marker
``stages/pack/split=<split>/source=<source>.json``, written last, says the pair is done for the current
parts. A later call packs only new document parts into new shards, so an incremental run appends without
rewriting old shards. A marker never vouches for a shard changed or deleted since: a shard whose bytes no
longer match what was recorded is packed again, by the call that wrote it, into the very same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.documents import document_part_files, document_part_fingerprint, iter_documents
from core.errors import ConfigError, StageMismatchError
from core.files.atomic import read_json, sha256_file
from core.layout import PACK_STATE_FILE as STATE_FILE
from core.layout import PACK_STATE_FILES, SHARD_FILES, TOKENIZER_FILE, pack_unit, pack_unit_pair, shard_part_number
from core.rundir import RunPaths
from core.shards.check import shard_intact
from core.shards.store import ShardInfo, ShardRows, shard_relpath, token_dtype_for_vocab, write_shard, write_shard_index
from core.stage import Inputs, Progress, Stage, run_stage
from tokenization.config import PackConfig
from tokenization.encode import encode_texts
from tokenization.pack import Packer
from tokenization.special_tokens import load_tokenizer, read_special_tokens
from tokenization.train_tokenizer import tokenizer_vocab_size

STATE_VERSION = 1
"""Bumped when state.json changes incompatibly; a state of another version is refused."""


class PackStage(Stage):
    """Kept documents -> ``shards/split=<split>/source=<source>/``, one unit per (split, source) pair.

    ``state.json`` beside the shards is its state (the parts packed, and by which call); a marker never vouches
    for a shard changed or deleted since (:meth:`changed_since`): the call that wrote it packs it again.
    """

    name = "pack"
    reads = ("ingest", "dedupe", "decontaminate", "tokenizer")
    progress_unit = "tokens"
    retries = 2

    def __init__(self, paths: RunPaths, config: PackConfig, sources: list[str]) -> None:
        super().__init__(paths)
        self.config, self.sources = config, list(sources)

    @classmethod
    def build(cls, run: Any) -> PackStage:
        """The recipe's text sources; for a run read from its run.yaml (no manifest files), the recorded manifests'
        text sources, else those the ingest plan holds."""
        manifests = [item.manifest for item in run.manifests]
        if not manifests and run.record is not None:
            manifests = run.record.manifests or []
        # a source with records: chat is the SFT data stage's (tokenization.chat.stage): rendered, not packed here
        sources = [source.name for manifest in manifests for source in manifest.sources if source.records == "text"]
        if not manifests and run.paths.ingest_plan.is_file():
            sources = sorted({part["source"] for part in read_json(run.paths.ingest_plan)["parts"]})
        return cls(run.paths, run.recipe.pack, sources)

    def units(self) -> list[str]:
        return [pack_unit(split, source) for split in SPLITS for source in self.sources]

    def label(self, unit: str | None) -> str:
        split, source = _split_source(unit)
        return f"pack {split}/{source}"

    def inputs(self, unit: str | None) -> Inputs:
        """The tokenizer (by sha256), seq_len and every document part's fingerprint; refuses a mismatched state."""
        split, source = _split_source(unit)
        if self.paths.tokenizer.is_file():
            tokenizer_sha256, _, parts = _pack_inputs(self.paths, split, source, self.config)
        else:  # the tokenizer stage has not run (tokenmill status of a partial run): run() says so, in one line
            tokenizer_sha256, parts = "missing", document_part_files(self.paths)
        return Inputs(settings={"seq_len": self.config.seq_len}, files={TOKENIZER_FILE: tokenizer_sha256},
                      upstream={f"ingest/{Path(name).stem}": value
                                for name, value in part_fingerprints(self.paths, parts).items()},
                      version=str(STATE_VERSION))

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.pack_state(*_split_source(unit))]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """Shards missing or changed since they were recorded (or a state that is not the marker's)."""
        state = read_json(self.paths.pack_state(*_split_source(unit)))
        if recorded["summary"] != shards_summary(state):
            return [self.paths.pack_state(*_split_source(unit))]
        damaged = sorted(_damaged_shards(self.paths, state))
        return [self.paths.root / state["shards"][number]["path"] for number in damaged]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        num_tokens = 0

        def advance(tokens: int) -> None:
            nonlocal num_tokens
            num_tokens += tokens
            on_progress(num_tokens, None)

        split, source = _split_source(unit)
        return shards_summary(_pack(self.paths, split, source, self.config, advance))


SPLITS = ("train", "val")


def _split_source(unit: str | None) -> tuple[str, str]:
    """``(split, source)`` of a unit ``split=<split>/source=<source>``."""
    return pack_unit_pair(str(unit))


def shards_summary(state: dict[str, Any]) -> dict[str, Any]:
    """What the flow prints for a pair (and its marker records): its shards, rows and tokens."""
    shards = state["shards"]
    return {"num_shards": len(shards), "num_rows": sum(info["num_rows"] for info in shards),
            "num_tokens": sum(info["num_tokens"] for info in shards)}


def _pack_inputs(paths: RunPaths, split: str, source: str,
                 config: PackConfig) -> tuple[str, dict[str, Any], list[Path]]:
    """(tokenizer sha256, the pair's state, the document parts); checks the tokenizer and the state."""
    if not paths.tokenizer.is_file():
        raise ConfigError(f"{paths.tokenizer}: no tokenizer; run the tokenizer stage before packing.")
    tokenizer_sha256 = sha256_file(paths.tokenizer)
    state = _load_state(shard_folder(paths, split, source), tokenizer_sha256, config.seq_len)
    return tokenizer_sha256, state, document_part_files(paths)


def part_fingerprints(paths: RunPaths, parts: list[Path]) -> dict[str, str]:
    """``{part file name: its kept documents' fingerprint}``: a part re-decided with other kept documents (new
    thresholds, :mod:`pipeline.ingest.redecide`) gets a new one."""
    return {part.name: document_part_fingerprint(paths, part) for part in parts}


def _repacked_if_parts_changed(folder: Path, state: dict[str, Any], fingerprints: dict[str, str]) -> dict[str, Any]:
    """``state``, or an empty one (its shards removed) when a part it packed now holds other documents.

    Any such part re-packs every (split, source): its changed kept set may change which copy dedupe keeps in
    other sources too. A state of before ``packed_fingerprints`` records them now, as unchanged."""
    recorded = state.get("packed_fingerprints")
    if recorded is None or all(fingerprints.get(name) == value for name, value in recorded.items()):
        return state
    _remove_unrecorded_shards(folder, 0)
    return {**state, **_empty_progress()}


def _damaged_shards(paths: RunPaths, state: dict[str, Any]) -> set[int]:
    """Numbers of the recorded shards that are missing or whose sha256 differs from the one recorded.

    Each file is hashed once per version (:func:`core.files.digests.file_sha256`: in this process, or cached by
    device, inode, size, mtime and ctime outside the run dir), so a skipped pair costs a ``stat`` per shard.
    """
    return {number for number, info in enumerate(state["shards"]) if not shard_intact(paths.root, ShardInfo(**info))}


def _rebuilt_if_damaged(paths: RunPaths, split: str, source: str, config: PackConfig, tokenizer_sha256: str,
                        state: dict[str, Any], parts: list[Path]) -> dict[str, Any]:
    """``state``, its damaged shards written again: each call that wrote one re-packs its parts into the same shard
    numbers (same documents and settings, same bytes). A state that does not record its calls (written before
    ``pack_calls``), or a re-pack that gives other shards (settings changed since), starts the pair over."""
    damaged = _damaged_shards(paths, state)
    if not damaged:
        return state
    if _repack_calls(paths, split, source, config, tokenizer_sha256, state, damaged, parts) and not _damaged_shards(
            paths, state):
        return state
    _remove_unrecorded_shards(shard_folder(paths, split, source), 0)
    return {**state, **_empty_progress()}


def _repack_calls(paths: RunPaths, split: str, source: str, config: PackConfig, tokenizer_sha256: str,
                  state: dict[str, Any], damaged: set[int], parts: list[Path]) -> bool:
    """Re-pack every recorded call that wrote one of the ``damaged`` shards; False when the state records no calls
    (or calls that are not over the run's document ``parts``) or a call's shards come out other than recorded."""
    calls = state.get("pack_calls")
    by_name = {part.name: part for part in parts}
    if not isinstance(calls, list) or not all(_is_call(call, by_name) for call in calls):
        return False
    for first, end, part_names in calls:
        if damaged & set(range(first, end)):
            writer = _ShardWriter(paths, split, source, tokenizer_sha256, first)
            _pack_parts(paths, split, source, config, [by_name[name] for name in part_names], writer, None)
            if [dataclasses.asdict(info) for info in writer.infos] != state["shards"][first:end]:
                return False
    return True


def _is_call(call: Any, parts: dict[str, Path]) -> bool:
    """Whether ``call`` is a ``pack_calls`` entry, ``[first shard, end shard, [part file names]]``, over ``parts``."""
    return (isinstance(call, list) and len(call) == 3 and all(isinstance(n, int) for n in call[:2])
            and isinstance(call[2], list) and all(isinstance(name, str) and name in parts for name in call[2]))


def _empty_progress() -> dict[str, Any]:
    """The state keys of a pair with nothing packed yet."""
    return {"vocab_size": 0, "packed_parts": [], "next_part": 0, "num_documents": 0, "shards": [], "pack_calls": []}


def pack_split_source(paths: RunPaths, split: str, source: str, config: PackConfig,
                      on_progress: Callable[[int], None] | None = None) -> list[ShardInfo]:
    """Encode and pack the not-yet-packed documents of (split, source) (:class:`PackStage`); return every shard
    of the pair.

    Shards hold ``config.rows_per_shard`` rows (the last one of a call fewer, its last row padded).
    Same input -> byte-identical shards. ``on_progress(num_tokens)`` hears of each encoded batch (BOS/EOS
    included: the calls add up to the new shards' ``num_tokens``). Raises ConfigError when the tokenizer
    is missing and StageMismatchError when earlier shards of the pair used another tokenizer or seq_len.
    """
    stage = PackStage(paths, config, [source])
    run_stage(stage, pack_unit(split, source),
              on_progress=None if on_progress is None else _per_batch(on_progress))
    state = read_json(paths.pack_state(split, source))
    return [ShardInfo(**info) for info in state["shards"]]


def _per_batch(on_progress: Callable[[int], None]) -> Progress:
    """``on_progress(num_tokens)`` per batch, from the runner's running total."""
    told = 0

    def progress(done: int, total: int | None) -> None:
        nonlocal told
        on_progress(done - told)
        told = done

    return progress


def _pack(paths: RunPaths, split: str, source: str, config: PackConfig,
          on_progress: Callable[[int], None] | None) -> dict[str, Any]:
    """The pair's new parts packed (its damaged shards rebuilt first); returns its state, written."""
    folder = shard_folder(paths, split, source)
    tokenizer_sha256, state, parts = _pack_inputs(paths, split, source, config)
    fingerprints = part_fingerprints(paths, parts)
    state = _repacked_if_parts_changed(folder, state, fingerprints)
    state = _rebuilt_if_damaged(paths, split, source, config, tokenizer_sha256, state, parts)
    infos = [ShardInfo(**info) for info in state["shards"]]
    new_parts = [part for part in parts if part.name not in state["packed_parts"]]
    if not new_parts:  # damaged shards rebuilt, or packed by a version that kept no marker under stages/
        state["packed_fingerprints"] = fingerprints
        paths.write_json(folder / STATE_FILE, state)
        return state
    paths.remove_stale_temps(folder)
    _remove_unrecorded_shards(folder, state["next_part"])
    writer = _ShardWriter(paths, split, source, tokenizer_sha256, state["next_part"])
    num_documents = _pack_parts(paths, split, source, config, new_parts, writer, on_progress)
    infos.extend(writer.infos)
    if state.get("pack_calls") is not None:  # which shards each call wrote, to rebuild a damaged one alike
        state["pack_calls"] = [*state["pack_calls"], [state["next_part"], writer.next_part,
                                                      [part.name for part in new_parts]]]
    state.update(
        split=split, source=source, tokenizer_sha256=tokenizer_sha256, seq_len=config.seq_len,
        vocab_size=writer.vocab_size,
        packed_parts=sorted([*state["packed_parts"], *(part.name for part in new_parts)]),
        next_part=writer.next_part, num_documents=state["num_documents"] + num_documents,
        shards=[dataclasses.asdict(info) for info in infos], packed_fingerprints=fingerprints,
    )
    paths.write_json(folder / STATE_FILE, state)  # the shards above are now committed
    return state




def write_index(paths: RunPaths) -> list[ShardInfo]:
    """Write ``shards/index.parquet`` from every (split, source) ``state.json``; return its rows by path."""
    infos = []
    for state_path in sorted(paths.shards.glob(PACK_STATE_FILES)):
        infos.extend(ShardInfo(**info) for info in read_json(state_path)["shards"])
    infos.sort(key=lambda info: info.path)
    write_shard_index(paths.root, infos)
    return infos


def shard_folder(paths: RunPaths, split: str, source: str) -> Path:
    """``shards/split=<split>/source=<source>/`` of the run."""
    return paths.shard_folder(split, source)


class _ShardWriter:
    """Numbers and writes the shards of one call, collecting their ShardInfo."""

    def __init__(self, paths: RunPaths, split: str, source: str, tokenizer_sha256: str, next_part: int) -> None:
        self.paths, self.split, self.source = paths, split, source
        self.tokenizer_sha256 = tokenizer_sha256
        self.next_part = next_part
        self.vocab_size = 0
        self.infos: list[ShardInfo] = []

    def write(self, rows: ShardRows) -> None:
        relpath = shard_relpath(self.split, self.source, self.next_part)
        self.infos.append(write_shard(self.paths.root, relpath, rows, split=self.split, source=self.source,
                                      tokenizer_sha256=self.tokenizer_sha256, vocab_size=self.vocab_size))
        self.next_part += 1


def _pack_parts(paths: RunPaths, split: str, source: str, config: PackConfig, parts: list[Path],
                writer: _ShardWriter, on_progress: Callable[[int], None] | None) -> int:
    """Stream the parts' documents through encode -> Packer -> shards; return how many documents were packed."""
    tokenizer = load_tokenizer(paths.tokenizer)
    special = read_special_tokens(paths)
    writer.vocab_size = tokenizer_vocab_size(tokenizer)
    packer = Packer(config.seq_len, special.eos_id, special.pad_id, token_dtype_for_vocab(writer.vocab_size),
                    bos_id=special.bos_id)
    num_documents = 0
    batches = iter_documents(paths, split=split, source=source, columns=["doc_id", "text"], parts=parts,
                             batch_rows=config.encode_batch_docs)
    for batch in batches:
        doc_ids = batch.column("doc_id").to_pylist()
        num_tokens_before = packer.num_added_tokens
        for doc_id, tokens in zip(doc_ids, encode_texts(tokenizer, batch.column("text").to_pylist()), strict=True):
            packer.add(doc_id, tokens)
        num_documents += len(doc_ids)
        if on_progress is not None:
            on_progress(packer.num_added_tokens - num_tokens_before)
        # Only whole shards mid-stream, so shard boundaries do not depend on the batch size.
        while packer.num_full_rows >= config.rows_per_shard:
            writer.write(packer.take_rows(config.rows_per_shard))
    rest = packer.finish()
    if rest is not None:
        writer.write(rest)
    return num_documents


def _load_state(folder: Path, tokenizer_sha256: str, seq_len: int) -> dict[str, Any]:
    """The recorded state of a (split, source) folder, or an empty one; refuses a mismatched state."""
    path = folder / STATE_FILE
    if not path.is_file():
        return {"version": STATE_VERSION, "tokenizer_sha256": tokenizer_sha256, "seq_len": seq_len,
                **_empty_progress()}
    state = read_json(path)
    recorded = {"version": state.get("version"), "tokenizer_sha256": state.get("tokenizer_sha256"),
                "seq_len": state.get("seq_len")}
    wanted = {"version": STATE_VERSION, "tokenizer_sha256": tokenizer_sha256, "seq_len": seq_len}
    for key, value in recorded.items():
        if value != wanted[key]:
            raise StageMismatchError(
                f"{path}: shards here were packed with {key}={value!r}, this run now has {key}={wanted[key]!r}; "
                "appending would mix them in one source. Use a fresh run dir (or delete shards/ to re-pack)."
            )
    return state


def _remove_unrecorded_shards(folder: Path, next_part: int) -> None:
    """Delete shards a killed call wrote after the last recorded state (they are re-made identically)."""
    for shard in folder.glob(SHARD_FILES):
        number = shard_part_number(shard)
        if number is not None and number >= next_part:
            shard.unlink()
