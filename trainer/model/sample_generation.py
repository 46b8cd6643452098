"""Exported model (``model/``) -> one sample generation in ``metrics/sample_generation.json``, made once per export.

The report shows it without loading a model: a report stays a render of the run's files. An export with a chat
template (a supervised fine-tuning run's) answers instead of continuing: the sample is its reply to the prompt,
rendered through the template as ``tokenmill generate --chat`` does (the record says ``"chat": true``). Whether the
file is current is answered from file stats (:func:`sample_is_current`, no torch); only a new export pays for
importing torch and sampling (:func:`write_sample_generation`).
"""

from __future__ import annotations

import json
from typing import Any

from core.documents import iter_documents
from core.errors import TokenmillError
from core.rundir import RunPaths, file_stats, fingerprint, path_inside_run

SAMPLE_SETTINGS = {"max_new_tokens": 64, "temperature": 0.8, "top_k": 50, "seed": 0}
"""How the sample is drawn (the ``tokenmill generate`` defaults, shorter): the same export gives the same text."""
PROMPT_CHARS = 40
"""The prompt is the first line of the first validation document, cut to this many characters."""
CHAT_PROMPT_CHARS = 400
"""For a chat model the first line is a message (a conversation's first): kept whole, up to this many characters."""


def export_fingerprint(paths: RunPaths) -> str | None:
    """The export's files (by :func:`core.rundir.file_stats`) and SAMPLE_SETTINGS; None without an export, or
    when the export or a file in it leads outside the run dir (a run dir's files are all that is read)."""
    if not paths.model_config.is_file():
        return None
    if not all(path_inside_run(paths.root, path) for path in [paths.model, *paths.model.iterdir()]):
        return None
    return fingerprint("sample-generation", SAMPLE_SETTINGS, file_stats(paths.root, paths.model))


def read_sample(paths: RunPaths) -> dict[str, Any] | None:
    """The recorded sample when it was made from the current export, else None (none, stale or unreadable)."""
    current = export_fingerprint(paths)
    if current is None or not path_inside_run(paths.root, paths.sample_generation):
        return None
    try:
        record = json.loads(paths.sample_generation.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("export_fingerprint") == current else None


def sample_is_current(paths: RunPaths) -> bool:
    """True when there is nothing to generate: no export, or a sample of the current one is recorded."""
    return export_fingerprint(paths) is None or read_sample(paths) is not None


def write_sample_generation(paths: RunPaths) -> dict[str, Any]:
    """Sample from ``model/`` (imports torch) and record it; returns the record.

    Keys: ``export_fingerprint``, ``prompt``, ``completion`` and SAMPLE_SETTINGS (and ``chat: true`` when the
    completion is a chat reply), or ``error`` (one line) when the export or the documents do not load: the report
    says so instead of failing, and a new export is tried again.
    """
    # torch and transformers: here, when a report samples, not when the report module is imported
    from trainer.model.generate import chat_reply, generate_text, load_chat_template_of, load_exported_model  # torch
    from trainer.model.hf_files import has_chat_template  # (with generate)

    current = export_fingerprint(paths)
    if current is None:
        raise TokenmillError(f"{paths.model}: no exported model (config.json); run `tokenmill train` first.")
    try:
        chat = has_chat_template(paths.model)
        prompt = sample_prompt(paths, CHAT_PROMPT_CHARS if chat else PROMPT_CHARS)
        model, tokenizer, special, context_len = load_exported_model(paths.model)
        if chat:
            completion = chat_reply(model, load_chat_template_of(paths.model), context_len, prompt, **SAMPLE_SETTINGS)
        else:
            completion = generate_text(model, tokenizer, special, context_len, prompt,
                                       **SAMPLE_SETTINGS)[len(prompt):]
        outcome: dict[str, Any] = {"prompt": prompt, "completion": completion, **SAMPLE_SETTINGS,
                                   **({"chat": True} if chat else {})}
    except TokenmillError as err:
        outcome = {"error": str(err).splitlines()[0]}
    record = {"export_fingerprint": current, **outcome}
    paths.write_json(paths.sample_generation, record)
    return record


def sample_prompt(paths: RunPaths, max_chars: int = PROMPT_CHARS) -> str:
    """The first line of the first kept validation document (of a train one without a val split), cut to
    ``max_chars``; ``""`` (generate from the start of a document) when the run has no documents."""
    for split in ("val", "train"):
        for batch in iter_documents(paths, split=split, columns=["doc_id", "split", "source", "text"]):
            if batch.num_rows:
                return str(batch.column("text")[0].as_py()).split("\n", 1)[0][:max_chars]
    return ""
