"""Model stage: the recipe's Hugging Face config or model folder -> ``RUN/base_model/`` (checked, then linked in).

Run once by ``tokenmill prepare`` before the tokenizer stage (which may use the model's own tokenizer). The
folder is checked first (a causal-LM config, no remote code unless allowed, safetensors only, every shard
present and readable), then its files are hard-linked into the run dir — copied where a link cannot be made
(another filesystem) — so the run dir holds everything the trainer reads, with no absolute path and no
symlink out, and a multi-gigabyte checkpoint costs no disk space. The stage marker fingerprints the files'
names, sizes and modification times, so a re-run with an unchanged folder does nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.files.atomic import TEMP_PREFIX, replace_folder, sha256_file
from core.layout import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from core.rundir import RunPaths
from core.stage import Inputs, Progress, Stage, run_stage
from trainer.config import ModelConfig
from trainer.model.hf_files import CONFIG_NAME, WEIGHTS_INDEX_NAME, config_file, weight_files

STAGE = "base-model"
COMPANION_FILES = ("generation_config.json", TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
                   CHAT_TEMPLATE_FILE)
"""Files of a model folder brought along when present (the tokenizer stage may use the model's tokenizer; the export
carries its chat template, :mod:`trainer.train`)."""


def import_base_model(paths: RunPaths, source: Path, model: ModelConfig) -> dict[str, Any]:
    """Check ``source`` (``model.hf_config`` / ``model.from_pretrained``, resolved) and link it into base_model/.

    Returns ``{"model_type", "files", "weights"}`` and ``skipped``. Raises ConfigError naming the file or key when
    the folder cannot be trained (see :mod:`trainer.model.hf_model`).
    """
    return run_stage(BaseModelStage(paths, Path(source), model)).as_summary()


class BaseModelStage(Stage):
    """The recipe's model folder (or config.json) -> ``base_model/``; left out for the built-in model."""

    name = STAGE

    def __init__(self, paths: RunPaths, source: Path, model: ModelConfig) -> None:
        super().__init__(paths)
        self.source, self.model = source, model

    @classmethod
    def build(cls, run: Any) -> BaseModelStage | None:
        written = run.recipe.model.hugging_face_path
        if written is None:
            return None
        model = run.recipe.model.model_copy(update={"trust_remote_code": run.trust.model_code})
        return cls(run.paths, (run.base / written).resolve(), model)

    def inputs(self, unit: str | None) -> Inputs:
        """The model settings and each file's name, size and mtime (gigabytes of weights are not read)."""
        return Inputs(settings=self.model.model_dump(mode="json"),
                      files={name: f"{size}:{mtime_ns}" for name, size, mtime_ns in
                             _file_stats(source_files(self.source, self.model))})

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.base_model]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """With ``trust_remote_code``, base_model/'s code must be the named folder's (a marker can be forged)."""
        differ = self.model.trust_remote_code and code_differences(self.source, self.paths.base_model)
        return [self.paths.base_model] if differ else []

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        # torch: `tokenmill status` imports stages
        from trainer.model.hf_model import load_causal_lm_config, read_weights

        config = load_causal_lm_config(self.source, self.model.trust_remote_code)
        files = source_files(self.source, self.model)
        if self.model.from_pretrained is not None:
            # Every shard opens and names its tensors (headers only: a large model is not read into memory twice).
            read_weights([path for path in files.values() if path.suffix == ".safetensors"], headers_only=True)
        _link_folder(files, self.paths.base_model)
        return {"model_type": config.model_type, "files": sorted(files),
                "weights": self.model.from_pretrained is not None, "config_sha256": sha256_file(files[CONFIG_NAME])}


def code_differences(source: Path, base_model: Path) -> list[str]:
    """Names of ``base_model/``'s config.json and Python files that are not byte-equal to the model folder's.

    With ``model.trust_remote_code`` the trainer imports the Python in ``base_model/``: it must be the code of the
    folder the user's recipe names, not whatever a copied run dir brought along (a stage marker can be forged).
    """
    folder = config_file(source).parent
    names = {CONFIG_NAME} | {path.name for path in [*folder.glob("*.py"), *base_model.glob("*.py")]}
    return sorted(name for name in names
                  if not ((folder / name).is_file() and (base_model / name).is_file()
                          and sha256_file(folder / name) == sha256_file(base_model / name)))


def source_files(source: Path, model: ModelConfig) -> dict[str, Path]:
    """``{name in base_model/: file}``: config.json, the companions present, and the weights for from_pretrained."""
    config = config_file(source)
    folder = config.parent
    files = {CONFIG_NAME: config}
    files.update({name: folder / name for name in COMPANION_FILES if (folder / name).is_file()})
    if model.trust_remote_code:  # the architecture's own Python files, which auto_map names
        files.update({path.name: path for path in sorted(folder.glob("*.py"))})
    if model.from_pretrained is not None:
        weights = weight_files(folder)
        files.update({path.name: path for path in weights})
        if (folder / WEIGHTS_INDEX_NAME).is_file():
            files[WEIGHTS_INDEX_NAME] = folder / WEIGHTS_INDEX_NAME
    return files


def _file_stats(files: dict[str, Path]) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of each file: a changed file changes the fingerprint without reading gigabytes."""
    return [(name, path.stat().st_size, path.stat().st_mtime_ns) for name, path in sorted(files.items())]


def _link_folder(files: dict[str, Path], target: Path) -> None:
    """Build ``target`` from hard links (copies across filesystems) under a temporary name, then swap it in."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{target.name}.", dir=target.parent))
    try:
        for name, path in files.items():
            _link_or_copy(path.resolve(), staging / name)
        replace_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _link_or_copy(source: Path, target: Path) -> None:
    if not source.is_file():
        raise ConfigError(f"{source}: not a regular file; copy the model folder again.")
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed: a copy
        shutil.copyfile(source, target)
