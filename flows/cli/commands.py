"""The ``tokenmill`` command line: run, prepare, train, query and verify a run."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand

from core.errors import TokenmillError
from core.eval_results import failed_results
from core.numbers import rounded_floats
from core.rundir import TASK_FILE_NAME, RunPaths
from core.seeds import MAX_SEED
from flows.cli.failures import user_error
from flows.cli.output import OutputFormat, emit_rows
from flows.cli.query_command import run_query_command
from flows.cli.sample_view import write_sample_rows
from flows.runtime.server import guard_temporary_server, start_temporary_server
from flows.runtime.settings import (
    QUIET_ENV,
    ConsoleFilter,
    configure_console,
    configure_environment,
    heartbeats_unless_temporary,
    show_library_progress,
)
from pipeline.ingest.worker_preload import INGEST_PRELOAD
from trainer.checkpoint.layout import MANIFEST_NAME, chosen_checkpoints, list_checkpoints
from trainer.model.hf_files import require_chat_template
from trainer.model.sampling_options import check_sampling

if TYPE_CHECKING:
    from flows.recipe import ResolvedRun, RunRecipe

T = TypeVar("T")

app = typer.Typer(help="tokenmill: corpora in, a trained and evaluated language model out.\n\n"
                       "Example: tokenmill run configs/tiny.yaml && tokenmill report runs/tiny",
                  invoke_without_command=True, pretty_exceptions_enable=False, add_completion=False)
shards_app = typer.Typer(help="Inspect and check the Arrow token shards of a run.\n\n"
                              "Example: tokenmill shards verify runs/tiny", invoke_without_command=True)
app.add_typer(shards_app, name="shards")
classifier_app = typer.Typer(help="Train a fastText quality classifier for filters.quality_classifier.\n\n"
                                  "Example: tokenmill classifier train good/ bad.jsonl --out model.bin",
                             invoke_without_command=True)
app.add_typer(classifier_app, name="classifier")

STATE: dict[str, Any] = {"debug": False, "quiet": False, "run_dir": None, "interrupted": False,
                         "temporary_server": False}


RecipeArg = Annotated[Path | None, typer.Argument(help="Recipe YAML (default: configs/tiny.yaml).")]
RunDirOpt = Annotated[str | None, typer.Option("--run-dir", help="Run directory (default: runs/<name>), or its URL "
                                                                 "in a bucket (s3://bucket/runs/NAME).")]
DaskOpt = Annotated[str | None, typer.Option("--dask-address",
                                              help="Run the data stages on this Dask scheduler (tcp://host:port).")]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", help="Output format: table, csv or json.")]
RunDirArg = Annotated[str, typer.Argument(help="Run directory, or its URL in a bucket (s3://bucket/runs/NAME).")]


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version  # ~12 ms: only --version

        typer.echo(f"tokenmill {version('tokenmill')}")
        raise typer.Exit()


def _help_without_a_command(ctx: typer.Context) -> None:
    """A group called with no command prints its help and exits 0 (click's ``no_args_is_help`` exits 2)."""
    if ctx.invoked_subcommand is None and not ctx.resilient_parsing:
        typer.echo(ctx.get_help())
        raise typer.Exit()


@shards_app.callback()
def _shards(ctx: typer.Context) -> None:
    _help_without_a_command(ctx)


@classifier_app.callback()
def _classifier(ctx: typer.Context) -> None:
    _help_without_a_command(ctx)


@app.callback()
def _main(ctx: typer.Context,
          debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors, and other "
                                                               "libraries' progress bars.")] = False,
          quiet: Annotated[bool, typer.Option("--quiet", "-q",
                                               help="No progress bars and no per-stage progress lines.")] = False,
          _version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                                 help="Print the version and exit.")] = False) -> None:
    STATE["debug"], STATE["quiet"] = debug, quiet
    if debug:
        show_library_progress()
    if quiet:
        os.environ[QUIET_ENV] = "1"
    _help_without_a_command(ctx)


@app.command()
def run(recipe: RecipeArg = None, run_dir: RunDirOpt = None, dask_address: DaskOpt = None) -> None:
    """Run the whole flow (prepare data, train, evaluate, export) through Prefect.

    Example: tokenmill run configs/tiny.yaml --run-dir runs/tiny
    """
    with bucket_run_dir(recipe, run_dir, "run") as loaded:
        _run_flow("run", "data_to_model", _checked_recipe(loaded, run_dir), dask_address=dask_address)


@app.command()
def prepare(recipe: RecipeArg = None, run_dir: RunDirOpt = None, dask_address: DaskOpt = None) -> None:
    """Data stages only: ingest, filter, dedupe, tokenizer, Arrow shards.

    Example: tokenmill prepare configs/tiny.yaml
    """
    with bucket_run_dir(recipe, run_dir, "prepare") as loaded:
        _run_flow("prepare", "prepare_on", _checked_recipe(loaded, run_dir), dask_address=dask_address)


@app.command()
def train(recipe: RecipeArg = None, run_dir: RunDirOpt = None) -> None:
    """Train, evaluate and export on the shards already in the run dir (resumes from the newest checkpoint).

    Example: tokenmill train configs/tiny.yaml
    """
    from core.shards.store import read_shard_index  # pyarrow (~0.3 s)

    with bucket_run_dir(recipe, run_dir, "train") as loaded:
        run = _checked_recipe(loaded, run_dir)
        read_shard_index(run.paths.root)  # no shards yet: one line now, not after a server start; no run dir left
        _run_flow("train", "train_model", run)


@app.command(name="eval")
def evaluate(run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
             checkpoint: Annotated[str | None, typer.Option(
                 "--checkpoint", help="STEP, last or all (default: the recipe's eval.checkpoints).")] = None,
             task: Annotated[str | None, typer.Option(
                 "--task", help="Only this task: val_split or an lm-eval task name (default: all).")] = None,
             recipe: Annotated[Path | None, typer.Option(
                 "--recipe", help="Take the eval and model settings from this recipe instead of the run dir's "
                                  "run.yaml: only then may the task folders it names run Python.")] = None) -> None:
    """Evaluate a run's checkpoints: the whole val split (per source, bits per byte) and the downstream tasks.

    Each (checkpoint, task) result is cached by both fingerprints: a re-run computes only what is missing.
    The settings come from the run dir's run.yaml, which is data: code it names is refused (SECURITY.md).
    Example: tokenmill eval runs/tiny --checkpoint all
    """
    from flows.recipe import resolve_recorded_run, resolve_run  # pydantic, pyarrow, YAML (~1 s)
    from flows.run_code import refuse_untrusted_code  # pydantic, pyarrow, YAML (~1 s)

    if checkpoint is not None and checkpoint not in ("last", "all") and not checkpoint.isdigit():
        raise TokenmillError(f"--checkpoint {checkpoint!r}: give a step number, last or all.")

    if task is not None and not TASK_FILE_NAME.match(task):
        raise TokenmillError(f"--task {task!r}: a task name has letters, digits, '_', '.' and '-' only.")
    run = resolve_run(recipe, run_dir) if recipe is not None else resolve_recorded_run(run_dir)
    STATE["run_dir"] = run.paths.root
    refuse_untrusted_code(run, task)  # before Prefect starts or anything is imported: one line

    chosen_checkpoints(run.paths, checkpoint or run.recipe.eval.checkpoints)  # a wrong step: one line, no Prefect
    with run.paths.lock():
        from flows.evaluation_state import cached_evaluation  # pydantic, pyarrow (~1 s)

        cached = cached_evaluation(run, checkpoint, task)
        if cached is not None:  # every result current: no Prefect server, no flow run (~1 s, not ~14)
            if not STATE["quiet"]:
                sys.stderr.write("eval: every result is current and nothing changed since: skipped without a flow "
                                 "run\n")
            _print_summary(cached)
            return
        flows_module = _import_flows_with_a_server()
        from flows.progress.bars import live_progress  # Prefect (~3 s)

        with live_progress(), heartbeats_unless_temporary(STATE["temporary_server"]):
            summary = flows_module.evaluate_model(run, checkpoint=checkpoint, task=task)
        _print_summary(summary)


class QueryCommand(TyperCommand):
    """``tokenmill query``: its help names every view of :func:`flows.run_sql.view_names`, read when the help is
    shown (the registry imports DuckDB: every other use of the command line would pay for it)."""

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        from flows.run_sql import view_names  # DuckDB, pandas (~0.8 s)

        self.help = (self.help or "").replace(VIEWS_PLACEHOLDER, ", ".join(view_names()))
        super().format_help(ctx, formatter)


VIEWS_PLACEHOLDER = "{views}"


@app.command(cls=QueryCommand, short_help="Read-only SQL over a run's views (documents, shards, metrics, …).")
def query(run_dir: RunDirArg,
          sql: Annotated[str, typer.Argument(help="One read-only SQL statement over the run's views.")],
          output_format: FormatOpt = OutputFormat.table) -> None:
    """Read-only SQL over a run's views: {views}.

    Example: tokenmill query runs/tiny "SELECT source, count(*) FROM documents GROUP BY source"
    (or s3://bucket/runs/tiny, with the AWS variables set: docs/object-storage.md).
    """
    run_query_command(run_dir, sql, output_format, on_interrupt=lambda: _exit_interrupted(now=True))


@app.command()
def serve(recipe: Annotated[str | None, typer.Option(help="Recipe for every deployment.")] = None,
          run_dir: RunDirOpt = None,
          limit: Annotated[int, typer.Option(help="Flow runs at a time.")] = 1) -> None:
    """Serve prefect.yaml's deployments as nightly-refresh-served (on its cron schedule) and one-shot-served
    until Ctrl-C (named apart from what `prefect deploy --all` registers).

    Needs a Prefect server: `prefect server start` and PREFECT_API_URL=http://127.0.0.1:4200/api.
    Example: tokenmill serve --recipe configs/tiny.yaml
    """
    from flows.serve import serve_deployments  # YAML (~50 ms); Prefect when serving

    _configure_console(say_errors_once=False, temporary_server=False)  # no final `error:` line: keep Prefect's
    guard_temporary_server()
    serve_deployments(recipe, _optional(run_dir), limit)


@app.command()
def generate(run_dir: Annotated[Path, typer.Argument(help="Run directory (uses its exported model/).")],
             prompt: Annotated[str, typer.Argument(help="Text to continue (with --chat: the user's message).")],
             max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to sample at most.")] = 100,
             temperature: Annotated[float, typer.Option(help="0 = greedy; higher = more varied.")] = 0.8,
             seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Sampling seed (same seed, same text).")] = 0,
             chat: Annotated[bool, typer.Option("--chat", help="Reply to PROMPT as the assistant, through the "
                                                "model's chat template (a fine-tuned model's export has one).")] = False
             ) -> None:
    """Sample a continuation of PROMPT from the run's exported model, or with --chat its reply to PROMPT.

    Example: tokenmill generate runs/tiny "def parse_args(" --max-new-tokens 60
    """
    check_sampling(prompt, temperature, seed)  # before torch and the model load: a bad option is one line, at once
    model_dir = RunPaths(run_dir).check_is_run().model
    if chat:
        require_chat_template(model_dir)  # so is a model with no template to chat with
    from trainer.model.generate import chat_reply, generate_text, load_chat_template_of, load_exported_model

    template = load_chat_template_of(model_dir) if chat else None
    model, tokenizer, special, context_len = load_exported_model(model_dir)
    if template is not None:
        typer.echo(chat_reply(model, template, context_len, prompt, max_new_tokens=max_new_tokens,
                              temperature=temperature, seed=seed))
        return
    typer.echo(generate_text(model, tokenizer, special, context_len, prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, seed=seed))


@app.command()
def report(run_dir: RunDirArg) -> None:
    """Write the run report (report/index.html: loss curves, data funnel, source mix, histograms, tables).

    Skipped when no file of the run changed since it was written. Example: tokenmill report runs/tiny
    """
    from flows.report.stage import report_is_current, write_report  # DuckDB, pandas, pydantic (~2 s)

    paths = RunPaths(local_run_dir(run_dir))
    current = report_is_current(paths)
    typer.echo(f"{'up to date' if current else 'wrote'} {write_report(paths)}")


@app.command()
def status(run_dir: RunDirArg,
           recipe: Annotated[Path | None, typer.Argument(
               help="Recipe to compare with (default: the run's own run.yaml).")] = None,
           output_format: FormatOpt = OutputFormat.table) -> None:
    """What a re-run would redo, and why: every stage and unit, done, stale or to do. Runs nothing.

    A stale unit names what changed: a file, a setting, an upstream stage that re-runs, a missing output.
    Example: tokenmill status runs/tiny configs/tiny.yaml
    """
    from flows.recipe import resolve_recorded_run, resolve_run  # pydantic, pyarrow, YAML (~1 s)
    from flows.stage_list import ALL_STAGES  # every stage's module
    from flows.status import run_status  # ~15 ms: only this command

    run = resolve_run(recipe, run_dir) if recipe is not None else resolve_recorded_run(local_run_dir(run_dir))
    run.paths.check_is_run()
    result = run_status(stage for cls in ALL_STAGES if (stage := cls.build(run)) is not None)
    if output_format == OutputFormat.json:
        typer.echo(json.dumps(result.as_json(), indent=2))
        return
    emit_rows(("stage", "unit", "state", "why"), result.rows(), output_format)
    if output_format == OutputFormat.table:
        for note in result.notes:
            typer.echo(f"note: {note}")
        typer.echo("up to date: a re-run does nothing" if result.up_to_date
                   else f"a re-run redoes: {', '.join(result.redo)}")


@shards_app.command("verify")
def shards_verify(run_dir: RunDirArg) -> None:
    """Check every shard against the index (sha256, schema, metadata, token ids < vocab); exit 1 on any fault.

    Example: tokenmill shards verify runs/tiny
    """
    from core.shards.store import read_shard_index, verify_shards  # pyarrow (~0.4 s)

    run_dir = local_run_dir(run_dir)
    faults = verify_shards(run_dir)
    for fault in faults:
        typer.echo(f"FAULT {fault}")
    if faults:
        typer.echo(f"{len(faults)} fault(s) in {run_dir}/shards; re-run `tokenmill prepare` on a fresh run dir.")
        raise typer.Exit(1)
    typer.echo(f"ok: {len(read_shard_index(run_dir))} shards match the index")


@shards_app.command("stats")
def shards_stats(run_dir: RunDirArg,
                 output_format: FormatOpt = OutputFormat.table) -> None:
    """Per split and source: shards, rows, tokens, documents, EOS and padding share, document-length histogram.

    Example: tokenmill shards stats runs/tiny --format json
    """
    from pipeline.shard_stats import shard_stats  # pyarrow (~0.4 s)

    rows = shard_stats(local_run_dir(run_dir), histogram="dict" if output_format is OutputFormat.json else "text")
    emit_rows(list(rows[0]) if rows else [], [list(row.values()) for row in rows], output_format)


@shards_app.command("sample")
def shards_sample(run_dir: RunDirArg,
                  n: Annotated[int, typer.Option("--n", min=1, help="Rows to sample.")] = 5,
                  seed: Annotated[int, typer.Option(min=0, max=MAX_SEED,
                                                    help="Sampling seed (same seed, same rows).")] = 0,
                  split: Annotated[str | None, typer.Option(help="Only this split (train/val).")] = None,
                  source: Annotated[str | None, typer.Option(help="Only this source.")] = None,
                  decode: Annotated[bool, typer.Option("--decode/--no-decode", help="Show text or token ids.")] = True,
                  output_format: FormatOpt = OutputFormat.table) -> None:
    """Random packed rows with the uris of the documents that fill them (decoded text by default).

    Example: tokenmill shards sample runs/tiny --n 3 --decode
    """
    from tokenization.sample import sample_rows  # tokenizers, pyarrow, pydantic (~1.6 s)

    rows = sample_rows(local_run_dir(run_dir), n, seed=seed, split=split, source=source, decode=decode)
    if output_format is OutputFormat.table:
        write_sample_rows(rows, sys.stdout)
        return
    emit_rows(list(rows[0]) if rows else [], [list(row.values()) for row in rows], output_format)


ExamplesArg = "Examples: a folder (one document per file; *.jsonl files one per line), a .jsonl file, or a text file " \
              "(one per line)."


@classifier_app.command("train")
def classifier_train(
        positive: Annotated[Path, typer.Argument(help=f"Documents to keep. {ExamplesArg}")],
        negative: Annotated[Path, typer.Argument(help=f"Documents to reject. {ExamplesArg}")],
        out: Annotated[Path, typer.Option("--out", help="The model file to write (fastText .bin).")],
        text_field: Annotated[str, typer.Option("--text-field", help="Text field of .jsonl examples.")] = "text",
        epoch: Annotated[int, typer.Option("--epoch", min=1, help="Passes over the examples.")] = 25,
        seed: Annotated[int, typer.Option("--seed", min=0, max=MAX_SEED,
                                          help="Training seed (same examples and seed, same model).")] = 0) -> None:
    """Train a fastText classifier of POSITIVE against NEGATIVE examples; use it as filters.quality_classifier.

    Prints the examples per label and the accuracy on the 10% held out. Example: tokenmill classifier train
    good/ bad.jsonl --out model.bin
    """
    # pydantic, YAML (~0.3 s)
    from pipeline.filters.quality_classifier import ClassifierTrainingConfig, train_classifier

    config = ClassifierTrainingConfig(text_field=text_field, epoch=epoch, seed=seed)
    typer.echo(train_classifier(positive, negative, out, config).line())


def local_run_dir(run_dir: str) -> Path:
    """``run_dir`` as a local folder: a URL (``s3://…``) becomes its local mirror (:mod:`pipeline.sql.run_mirror`),
    fetched or brought up to date first, for the commands that memory-map, hash or write files. RunDirError when
    the folder holds no run (:meth:`core.rundir.RunPaths.check_is_run`)."""
    from pipeline.objects import is_remote  # logging (~13 ms): only for a bucket

    if not is_remote(run_dir):
        return RunPaths(run_dir).check_is_run().root
    from pipeline.sql.run_mirror import mirror_run  # ~25 ms: only for a bucket

    local = mirror_run(run_dir)
    typer.echo(f"reading {run_dir} through its local mirror {local}", err=True)
    return RunPaths(local).check_is_run().root


@contextlib.contextmanager
def bucket_run_dir(recipe: Path | None, run_dir: str | None, command: str) -> Iterator[tuple[RunRecipe, Path]]:
    """Load the recipe (once: the block gets it, with its folder, to resolve); for a run dir in a bucket
    (``--run-dir s3://…`` or the recipe's ``run_dir``): hold its lock across machines, pull it into its working
    copy, run the command there, then publish what changed, markers last (also when the command failed or was
    interrupted: what finished is kept). Nothing more for a local run dir.

    See :mod:`core.bucket.run_dir` and :mod:`core.bucket.lock`.
    """
    from flows.recipe import DEFAULT_RECIPE, load_recipe, run_dir_url  # pydantic, pyarrow, YAML (~1 s)

    loaded = load_recipe(recipe or DEFAULT_RECIPE)
    url = run_dir_url(loaded[0], run_dir)
    if url is None:
        yield loaded
        return
    from core.bucket.lock import BucketLock  # ~8 ms: only for a bucket
    from core.bucket.run_dir import BUCKET_RUN_ENV, BucketRun  # ~25 ms: only for a bucket

    with BucketLock(url, f"tokenmill {command}") as lock:
        bucket_run = BucketRun(url, lock=lock)
        local = bucket_run.pull()
        if not STATE["quiet"]:
            sys.stderr.write(f"{command}: working on {url} through its local copy {local}\n")
        os.environ[BUCKET_RUN_ENV] = f"{url} {local}"  # the launched trainer publishes each checkpoint
        try:
            yield loaded
        except BaseException:
            try:
                bucket_run.publish()  # what finished before the error is kept, as in a local run dir
            except Exception as err:  # the command's own error is the one raised
                sys.stderr.write(f"{command}: could not publish to {url} after the error ({err})\n")
            raise
        finally:
            os.environ.pop(BUCKET_RUN_ENV, None)
        published = bucket_run.publish()
        if not STATE["quiet"]:
            sys.stderr.write(f"{command}: published {published} changed key(s) to {url}\n")


def _run_flow(command: str, flow_name: str, run: ResolvedRun, **options: Any) -> None:
    """What ``run``, ``prepare`` and ``train`` share: lock the checked run's dir, run the flow, print it.

    ``flow_name`` names the function of :mod:`flows.pipeline` (imported only now: it imports Prefect), called
    as ``flow(run, **options)``.

    The lock is taken before Prefect starts, so a second process gets one clean line, not a failed flow; the
    flows take it again (it nests within a process). Inside it, the Prefect server comes up
    (:func:`_import_flows_with_a_server`; after the lock: a refused command starts no server). Unless every unit
    of ``command``'s stages is done as when it last finished here (:mod:`flows.up_to_date`): then its summary is
    printed again and neither Prefect nor a server starts.
    """
    from flows.up_to_date import sealed_summary, write_seal  # pydantic, pyarrow, YAML (~1 s)

    STATE["run_dir"] = run.paths.root
    with run.paths.lock():
        ingests = command in ("run", "prepare") and options.get("dask_address") is None
        if command in ("run", "prepare"):
            _refuse_unmatched_sources(run)
        sealed = sealed_summary(run, command)
        if sealed is not None:
            if not STATE["quiet"]:
                sys.stderr.write(f"{command}: nothing changed since it last finished on this run dir, every stage is "
                                 "up to date: skipped without a flow run\n")
            _print_summary(sealed)
            return
        flows_module = _import_flows_with_a_server(_start_ingest_workers if ingests else None)
        from flows.progress.bars import live_progress  # Prefect (~3 s)

        with live_progress(), heartbeats_unless_temporary(STATE["temporary_server"]):
            summary = getattr(flows_module, flow_name)(run, **options)
        _print_summary(summary)
        if not failed_results(run.paths):  # a failed evaluation result is retried by the next run
            with contextlib.suppress(OSError, TokenmillError):  # no seal (a full disk): the next run takes the flow
                write_seal(run, command, json.loads(json.dumps(summary, default=str)))


def _import_flows_with_a_server(start_workers: Callable[[], None] | None = None) -> ModuleType:
    """Import :mod:`flows.pipeline` (and so Prefect) with a Prefect server ready for its flows.

    With no server configured, tokenmill's temporary server is started first, so it boots while Prefect and
    the flows are imported (flows.runtime.server.start_temporary_server); with a Prefect home of the user's own,
    Prefect starts one when it needs it, guarded the same way (flows.runtime.server.guard_temporary_server).

    ``start_workers`` (a flow that will ingest) is called where its imports cost the least on 2 cores: at
    once when no server boots, beside Prefect's imports; after them when one does, so that the server's boot
    (~3.9 CPU-s, the longest path) has a core of its own, and the workers' imports fill the wait for it.
    """
    server = start_temporary_server(log_to_terminal=STATE["debug"])
    STATE["temporary_server"] = server is not None
    if start_workers is not None and server is None:
        start_workers()
    import flows.pipeline  # Prefect and every stage (~5 s)

    _configure_console(say_errors_once=True, temporary_server=server is not None)
    if server is not None:
        if start_workers is not None:
            start_workers()
        server.wait_until_ready()
    else:
        guard_temporary_server()
    return flows.pipeline


def _start_ingest_workers() -> None:
    """Start the fork server of the ingest workers (flows.runtime.stage_processes), which imports what they need."""
    if (os.cpu_count() or 1) > 1:
        from flows.runtime.stage_processes import start_fork_server  # multiprocessing (~30 ms): only when stages run

        start_fork_server(INGEST_PRELOAD)


def _checked_recipe(loaded: tuple[RunRecipe, Path], run_dir: str | None) -> ResolvedRun:
    """Load the manifests and the run dir's run.yaml, check the sources' paths and refuse a changed recipe, before
    Prefect starts: one clean line.

    Returns the run: the recipe (as :func:`bucket_run_dir` loaded it), its manifests, and the run dir it resolves
    to (``--run-dir``, else the recipe's, else ``runs/<name>``); each read once, for the whole command.
    """
    from flows.recipe import check_chat_template, refuse_changed_run, resolve_loaded  # pydantic, pyarrow, YAML
    from pipeline.manifest import resolve_source_path  # pydantic, pyarrow, YAML (~1 s)

    run = resolve_loaded(*loaded, run_dir)
    for item in run.manifests:
        for source in item.manifest.sources:
            resolve_source_path(source, item.path)
    refuse_changed_run(run)
    check_chat_template(run)  # a recipe with chat sources: its template must fit the model's tokenizer
    return run


def _refuse_unmatched_sources(run: ResolvedRun) -> None:
    """A source that matches no file (a glob typo) is one line naming it, before Prefect starts (ManifestError from
    :func:`pipeline.ingest.stage.list_source_files`). Sources the run's plan lists already are not walked again."""
    from pipeline.ingest.stage import collect_sources, list_source_files  # pydantic, pyarrow, YAML (~1 s)
    from pipeline.ingest.unmatched_source import matched_before  # pydantic, pyarrow, YAML (~1 s)

    with warnings.catch_warnings():  # the flow's planning says them, once
        warnings.simplefilter("ignore")
        for manifest_path, source in collect_sources(list(run.manifests)).values():
            if not matched_before(run.paths.root, source.name):
                list_source_files(source, manifest_path, run.paths.root)


def _configure_console(*, say_errors_once: bool, temporary_server: bool) -> None:
    """Prefect's console logging exists once flows.pipeline is imported: filter it
    (flows.runtime.settings.ConsoleFilter).

    ``--debug`` shows everything; ``--quiet`` shows warnings and errors only.
    """
    if not STATE["debug"]:
        configure_console(ConsoleFilter(say_errors_once=say_errors_once, hide_view_links=temporary_server),
                          quiet=STATE["quiet"])


def _optional(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _print_summary(summary: dict[str, Any]) -> None:
    """The summary as JSON, every float to 4 significant digits (the run dir's files keep full precision)."""
    typer.echo(json.dumps(rounded_floats(summary), indent=2, default=str))


def usage_error_line(err: typer.TyperException) -> str:
    """One line for a bad command line: the problem and where the right usage is shown."""
    context = getattr(err, "ctx", None)
    see = f" (see: {context.command_path} --help)" if context is not None else ""
    return f"error: {err.format_message()}{see}"


def main() -> None:
    """Console-script entry point: user errors become one line on stderr and exit status 2; Ctrl-C exits 130."""
    configure_environment()
    signal.signal(signal.SIGINT, _on_ctrl_c)
    try:
        command = without_type_tags(typer.main.get_command(app))
        exit_code = command(standalone_mode=False)  # click returns typer.Exit's code instead of raising it
    except KeyboardInterrupt:
        _exit_interrupted()
    except Exception as err:
        if STATE["interrupted"]:  # whatever the Ctrl-C ended as (DuckDB raises "RuntimeError: Query interrupted")
            _exit_interrupted()
        _exit_on_error(err)
    if STATE["interrupted"]:  # typer returns 130 for a KeyboardInterrupt in a command
        _exit_interrupted()
    sys.exit(exit_code if isinstance(exit_code, int) else 0)


def without_type_tags(command: T) -> T:
    """``command`` (and its sub-commands) with ``--help`` showing no type tag (``<str>``, ``<bool>``, ``<int
    range>``) beside each option and argument: the help text says what a value is, and a flag takes none.
    Ranges (``[x>=1]``) stay."""
    help_option = command.get_help_option(typer.Context(command))  # made once and kept by the command
    for param in [*command.params, *([help_option] if help_option is not None else [])]:
        param.display_type_rich = _no_type_tag
    for sub_command in getattr(command, "commands", {}).values():  # a group's
        without_type_tags(sub_command)
    return command


def _no_type_tag(ctx: typer.Context) -> None:
    return None


def _exit_on_error(err: Exception) -> NoReturn:
    """A user error (an OS limit on a path too, or the temporary server failing for one: flows.cli.failures): one
    line, exit 2; a usage error: one line and click's status; anything else: re-raised."""
    if isinstance(err, typer.Exit):
        sys.exit(err.exit_code)
    if isinstance(err, typer.Abort):
        _exit_interrupted()
    if not STATE["debug"] and not isinstance(err, TokenmillError | typer.TyperException):
        err = user_error(err, temporary_server=STATE["temporary_server"]) or err
    if STATE["debug"] or not isinstance(err, TokenmillError | typer.TyperException):
        raise err
    if isinstance(err, TokenmillError):
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    typer.echo(usage_error_line(err), err=True)  # typer raises its own bundled click's exceptions, not click's
    sys.exit(err.exit_code)


def _on_ctrl_c(signum: int, frame: FrameType | None) -> None:
    """The first Ctrl-C interrupts the command (it stops its children and exits 130); a second one exits now.

    Exiting at once leaves nothing behind: the trainer and the temporary server each exit within a second of
    tokenmill's death (trainer.parallel.launch.exit_with_parent, flows.runtime.server), and every write is atomic.
    """
    if STATE["interrupted"]:
        _exit_interrupted(now=True)
    STATE["interrupted"] = True
    raise KeyboardInterrupt


def _exit_interrupted(now: bool = False) -> NoReturn:
    """One line: what the run dir keeps and how to resume; exit 130 (``now``: without Python's exit handlers)."""
    run_dir = STATE["run_dir"]
    line = "interrupted"
    if run_dir is not None:
        again = shlex.join(["tokenmill", *sys.argv[1:]])
        line += f": {run_dir} keeps {kept_in_run_dir(run_dir)}; run `{again}` to resume"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if now:
        os._exit(130)
    sys.exit(130)


def kept_in_run_dir(run_dir: Path) -> str:
    """What an interrupted run leaves to resume from: its newest complete checkpoint and its finished stages."""
    paths = RunPaths(run_dir)
    complete = [step for step, folder in list_checkpoints(paths.checkpoints) if (folder / MANIFEST_NAME).is_file()]
    markers = paths.stages.iterdir() if paths.stages.is_dir() else []
    stages = {entry.stem for entry in markers if entry not in (paths.seals, paths.launch_config)}
    kept = [f"checkpoint step {complete[-1]}"] if complete else []
    kept.append(f"{len(stages)} finished stage(s)" if stages else "no finished stage")
    return " and ".join(kept)
