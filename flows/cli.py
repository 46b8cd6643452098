"""The ``tokenmill`` command line: run, prepare, train, query and verify a run."""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from core.errors import TokenmillError
from core.rundir import RunPaths
from core.seeds import MAX_SEED
from flows.server import guard_temporary_server, start_temporary_server
from flows.settings import QUIET_ENV, configure_environment

if TYPE_CHECKING:
    from flows.recipe import ResolvedRun

app = typer.Typer(help="tokenmill: corpora in, a trained and evaluated language model out.\n\n"
                       "Example: tokenmill run configs/tiny.yaml && tokenmill report runs/tiny",
                  invoke_without_command=True, pretty_exceptions_enable=False, add_completion=False)
shards_app = typer.Typer(help="Inspect and check the Arrow token shards of a run.\n\n"
                              "Example: tokenmill shards verify runs/tiny", invoke_without_command=True)
app.add_typer(shards_app, name="shards")

STATE = {"debug": False}


class OutputFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


RecipeArg = Annotated[Path | None, typer.Argument(help="Recipe YAML (default: configs/tiny.yaml).")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default: runs/<name>).")]
DaskOpt = Annotated[str | None, typer.Option("--dask-address",
                                              help="Run the data stages on this Dask scheduler (tcp://host:port).")]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", help="Output format: table, csv or json.")]


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

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


@app.callback()
def _main(ctx: typer.Context,
          debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
          quiet: Annotated[bool, typer.Option("--quiet", "-q",
                                               help="No progress bars and no per-stage progress lines.")] = False,
          _version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                                 help="Print the version and exit.")] = False) -> None:
    STATE["debug"] = debug
    if quiet:
        os.environ[QUIET_ENV] = "1"
    _help_without_a_command(ctx)


@app.command()
def run(recipe: RecipeArg = None, run_dir: RunDirOpt = None, dask_address: DaskOpt = None) -> None:
    """Run the whole flow (prepare data, train, evaluate, export) through Prefect.

    Example: tokenmill run configs/tiny.yaml --run-dir runs/tiny
    """
    _run_flow("data_to_model", recipe, run_dir, dask_address=dask_address)


@app.command()
def prepare(recipe: RecipeArg = None, run_dir: RunDirOpt = None, dask_address: DaskOpt = None) -> None:
    """Data stages only: ingest, filter, dedupe, tokenizer, Arrow shards.

    Example: tokenmill prepare configs/tiny.yaml
    """
    _run_flow("prepare_on", recipe, run_dir, dask_address=dask_address)


@app.command()
def train(recipe: RecipeArg = None, run_dir: RunDirOpt = None) -> None:
    """Train, evaluate and export on the shards already in the run dir (resumes from the newest checkpoint).

    Example: tokenmill train configs/tiny.yaml
    """
    _run_flow("train_model", recipe, run_dir)


@app.command(name="eval")
def evaluate(run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
             checkpoint: Annotated[str | None, typer.Option(
                 "--checkpoint", help="STEP, last or all (default: the recipe's eval.checkpoints).")] = None,
             task: Annotated[str | None, typer.Option(
                 "--task", help="Only this task: val_split or an lm-eval task name (default: all).")] = None) -> None:
    """Evaluate a run's checkpoints: the whole val split (per source, bits per byte) and the downstream tasks.

    Each (checkpoint, task) result is cached by both fingerprints: a re-run computes only what is missing.
    Example: tokenmill eval runs/tiny --checkpoint all
    """
    from flows.recipe import resolve_recorded_run

    if checkpoint is not None and checkpoint not in ("last", "all") and not checkpoint.isdigit():
        raise TokenmillError(f"--checkpoint {checkpoint!r}: give a step number, last or all.")
    from core.rundir import TASK_FILE_NAME

    if task is not None and not TASK_FILE_NAME.match(task):
        raise TokenmillError(f"--task {task!r}: a task name has letters, digits, '_', '.' and '-' only.")
    run = resolve_recorded_run(run_dir)
    from trainer.eval_plan import chosen_checkpoints

    chosen_checkpoints(run.paths, checkpoint or run.recipe.eval.checkpoints)  # a wrong step: one line, no Prefect
    with run.paths.lock():
        flows_module = _import_flows_with_a_server()
        from flows.progress import live_progress

        with live_progress():
            summary = flows_module.evaluate_model(run, checkpoint=checkpoint, task=task)
        _print_summary(summary)


@app.command()
def query(run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
          sql: Annotated[str, typer.Argument(help="One read-only SQL statement over the run's views.")],
          output_format: FormatOpt = OutputFormat.table) -> None:
    """Read-only SQL over a run: documents, rejects, duplicates, shards, sequences, train_metrics, eval_metrics.

    Example: tokenmill query runs/tiny "SELECT source, count(*) FROM documents GROUP BY source"
    """
    from pipeline.query import run_query

    table = run_query(run_dir, sql)
    _emit(table.column_names, [list(row.values()) for row in table.to_pylist()], output_format)


@app.command()
def serve(recipe: Annotated[str | None, typer.Option(help="Recipe for every deployment.")] = None,
          run_dir: RunDirOpt = None,
          limit: Annotated[int, typer.Option(help="Flow runs at a time.")] = 1) -> None:
    """Serve prefect.yaml's deployments (nightly-refresh on its cron schedule, one-shot) until Ctrl-C.

    Needs a Prefect server: `prefect server start` and PREFECT_API_URL=http://127.0.0.1:4200/api.
    Example: tokenmill serve --recipe configs/tiny.yaml
    """
    from flows.serve import serve_deployments

    _hide_user_error_tracebacks()
    guard_temporary_server()
    serve_deployments(recipe, _optional(run_dir), limit)


@app.command()
def generate(run_dir: Annotated[Path, typer.Argument(help="Run directory (uses its exported model/).")],
             prompt: Annotated[str, typer.Argument(help="Text to continue.")],
             max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to sample at most.")] = 100,
             temperature: Annotated[float, typer.Option(help="0 = greedy; higher = more varied.")] = 0.8,
             seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Sampling seed (same seed, same text).")] = 0
             ) -> None:
    """Sample a continuation of PROMPT from the run's exported model.

    Example: tokenmill generate runs/tiny "def parse_args(" --max-new-tokens 60
    """
    from trainer.generate import check_sampling, generate_text, load_exported_model

    check_sampling(prompt, temperature, seed)  # before the model loads: a bad option is one line, at once
    model, tokenizer, special, context_len = load_exported_model(RunPaths(run_dir).model)
    typer.echo(generate_text(model, tokenizer, special, context_len, prompt, max_new_tokens=max_new_tokens,
                             temperature=temperature, seed=seed))


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="Run directory.")]) -> None:
    """Write the run report (report/index.html: loss curves, data funnel, source mix, histograms, tables).

    Skipped when no file of the run changed since it was written. Example: tokenmill report runs/tiny
    """
    from flows.report import report_is_current, write_report

    paths = RunPaths(run_dir)
    current = report_is_current(paths)
    typer.echo(f"{'up to date' if current else 'wrote'} {write_report(paths)}")


@shards_app.command("verify")
def shards_verify(run_dir: Annotated[Path, typer.Argument(help="Run directory.")]) -> None:
    """Check every shard against the index (sha256, schema, metadata, token ids < vocab); exit 1 on any fault.

    Example: tokenmill shards verify runs/tiny
    """
    from core.shards import read_shard_index, verify_shards

    faults = verify_shards(run_dir)
    for fault in faults:
        typer.echo(f"FAULT {fault}")
    if faults:
        typer.echo(f"{len(faults)} fault(s) in {run_dir}/shards; re-run `tokenmill prepare` on a fresh run dir.")
        raise typer.Exit(1)
    typer.echo(f"ok: {len(read_shard_index(run_dir))} shards match the index")


@shards_app.command("stats")
def shards_stats(run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
                 output_format: FormatOpt = OutputFormat.table) -> None:
    """Per split and source: shards, rows, tokens, documents, EOS and padding share, document-length histogram.

    Example: tokenmill shards stats runs/tiny --format json
    """
    from pipeline.shard_stats import shard_stats

    rows = shard_stats(run_dir, histogram="dict" if output_format is OutputFormat.json else "text")
    _emit(list(rows[0]) if rows else [], [list(row.values()) for row in rows], output_format)


@shards_app.command("sample")
def shards_sample(run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
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
    from tokenization.sample import sample_rows

    rows = sample_rows(run_dir, n, seed=seed, split=split, source=source, decode=decode)
    _emit(list(rows[0]) if rows else [], [list(row.values()) for row in rows], output_format)


def _run_flow(flow_name: str, recipe: Path | None, run_dir: Path | None, **options: Any) -> None:
    """What ``run``, ``prepare`` and ``train`` share: check the recipe, lock the run dir, run the flow, print it.

    ``flow_name`` names the function of :mod:`flows.pipeline` (imported only now: it imports Prefect), called
    as ``flow(run, **options)``.

    The recipe is read once, here, and the flows get the resolved run (a deployment starts them with a path
    instead). The lock is taken before Prefect starts, so a second process gets one
    clean line, not a failed flow; the flows take it again (it nests within a process). Inside it, the Prefect
    server comes up (:func:`_import_flows_with_a_server`; after the lock: a refused command starts no server).
    """
    run = _checked_recipe(recipe, run_dir)
    with run.paths.lock():
        flows_module = _import_flows_with_a_server()
        from flows.progress import live_progress

        with live_progress():
            summary = getattr(flows_module, flow_name)(run, **options)
        _print_summary(summary)


def _import_flows_with_a_server() -> ModuleType:
    """Import :mod:`flows.pipeline` (and so Prefect) with a Prefect server ready for its flows.

    With no server configured, tokenmill's temporary server is started first, so it boots while Prefect and
    the flows are imported (flows.server.start_temporary_server); with a Prefect home of the user's own,
    Prefect starts one when it needs it, guarded the same way (flows.server.guard_temporary_server).
    """
    server = start_temporary_server()
    import flows.pipeline

    _hide_user_error_tracebacks()
    if server is not None:
        server.wait_until_ready()
    else:
        guard_temporary_server()
    return flows.pipeline


def _checked_recipe(recipe: Path | None, run_dir: Path | None) -> ResolvedRun:
    """Validate the recipe and its manifests before Prefect starts, so user errors are one clean line.

    Returns the run: the recipe and the run dir it resolves to (``--run-dir``, else the recipe's, else
    ``runs/<name>``).
    """
    from flows.recipe import DEFAULT_RECIPE, manifest_paths, resolve_run
    from pipeline.manifest import load_manifest, resolve_source_path

    run = resolve_run(recipe or DEFAULT_RECIPE, run_dir)
    for manifest_path in manifest_paths(run.recipe, run.base):
        for source in load_manifest(manifest_path).sources:
            resolve_source_path(source, manifest_path)
    return run


def _hide_user_error_tracebacks() -> None:
    """Prefect's console logging exists once flows.pipeline is imported; unless --debug, filter it."""
    if not STATE["debug"]:
        from flows.settings import hide_user_error_tracebacks

        hide_user_error_tracebacks()


def _optional(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _print_summary(summary: dict[str, Any]) -> None:
    typer.echo(json.dumps(summary, indent=2, default=str))


def _emit(columns: list[str], rows: list[list[Any]], output_format: OutputFormat) -> None:
    rows = [[_plain(value) for value in row] for row in rows]
    if output_format is OutputFormat.json:
        typer.echo(json.dumps([dict(zip(columns, row, strict=True)) for row in rows], indent=2, default=str))
    elif output_format is OutputFormat.csv:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        typer.echo(buffer.getvalue(), nl=False)
    else:
        from rich.console import Console
        from rich.table import Column, Table
        from rich.text import Text

        # Cells are data (a uri, a record's text): Text() shows them as they are, never as rich markup
        # ("[/]" would crash the table, "[link=…]" would become a terminal hyperlink).
        table = Table(*(Column(header=Text(column)) for column in columns))
        for row in rows:
            table.add_row(*(Text(str(value)) for value in row))
        Console().print(table)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def usage_error_line(err: typer.TyperException) -> str:
    """One line for a bad command line: the problem and where the right usage is shown."""
    context = getattr(err, "ctx", None)
    see = f" (see: {context.command_path} --help)" if context is not None else ""
    return f"error: {err.format_message()}{see}"


def main() -> None:
    """Console-script entry point: user errors become one line on stderr and exit status 2."""
    configure_environment()
    try:
        exit_code = app(standalone_mode=False)  # click returns typer.Exit's code instead of raising it
    except TokenmillError as err:
        if STATE["debug"]:
            raise
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except typer.TyperException as err:  # usage errors: typer raises its own bundled click's, not click's
        if STATE["debug"]:
            raise
        typer.echo(usage_error_line(err), err=True)
        sys.exit(err.exit_code)
    sys.exit(exit_code if isinstance(exit_code, int) else 0)
