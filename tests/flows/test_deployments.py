"""prefect.yaml's deployments against a real `prefect server start`, served locally, on a run with work to do.

The work-pool path (`prefect work-pool create`, `prefect deploy --all`, a process worker running one-shot in the
deploying checkout) is tested by tests/test_readme_commands.py with docs/orchestration.md's own commands; a flow run
started by a worker and one started by `tokenmill serve` are the same flow in the same kind of subprocess, so
one deployment doing real work (prepare, ten steps, evaluation) is enough here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.flows.conftest import write_small_recipe
from tests.flows.prefect_server import PREFECT, background, running_prefect_server, server_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("prefect-home")
    with running_prefect_server(home) as api_url:
        yield api_url, home


def prefect(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def wait_for_deployment(name: str, env: dict[str, str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if prefect("deployment", "inspect", name, env=env, timeout=60).returncode == 0:
            return
        time.sleep(2)
    raise AssertionError(f"deployment {name} never appeared")


def final_eval_step(run_dir: Path) -> int:
    rows = [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    return rows[-1]["step"]


def test_served_nightly_refresh_runs_to_completion(api: tuple[str, Path], tmp_path: Path) -> None:
    api_url, home = api
    env = server_env(home, api_url)
    recipe = write_small_recipe(tmp_path, max_steps=10)
    run_dir = tmp_path / "served-run"
    with background([TOKENMILL, "serve", "--recipe", str(recipe), "--run-dir", str(run_dir)], env,
                    tmp_path / "serve.log"):
        wait_for_deployment("data-to-model/nightly-refresh-served", env)
        result = prefect("deployment", "run", "data-to-model/nightly-refresh-served", "--watch",
                         "--watch-interval", "2", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Completed" in result.stdout
    assert final_eval_step(run_dir) == 10
    schedule = prefect("deployment", "inspect", "data-to-model/nightly-refresh-served", env=env, timeout=60).stdout
    assert "0 2 * * *" in schedule


def test_served_schedules_keep_prefect_yaml_time_zones() -> None:
    """`tokenmill serve` reads the same schedules as `prefect deploy`, time zone included, inactive ones left out."""
    from flows.serve import cron_schedules, load_deployment_specs

    nightly = next(spec for spec in load_deployment_specs() if spec["name"] == "nightly-refresh")
    (schedule,) = cron_schedules(nightly)
    assert (schedule.cron, schedule.timezone) == ("0 2 * * *", "UTC")
    spec = {"schedules": [{"cron": "30 4 * * 1", "timezone": "Europe/Berlin"}, {"cron": "0 * * * *", "active": False}]}
    assert [(s.cron, s.timezone) for s in cron_schedules(spec)] == [("30 4 * * 1", "Europe/Berlin")]


def test_served_deployments_are_named_apart_from_the_deployed_ones(prefect_server: None) -> None:
    """`tokenmill serve` registers `<name>-served`: `prefect deploy --all` registers prefect.yaml's names (with
    the work pool), and one name registered both ways would take the other's work pool and parameters."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from flows.serve import load_deployment_specs, served_deployments

    for deployment in served_deployments(recipe="served.yaml", run_dir="runs/served"):
        deployment.apply()
    with get_client(sync_client=True) as client:
        for spec in load_deployment_specs():
            served = client.read_deployment_by_name(f"data-to-model/{spec['name']}-served")
            assert served.parameters == {"recipe": "served.yaml", "run_dir": "runs/served"}
            assert served.work_pool_name is None
            with pytest.raises(ObjectNotFound):  # left to `prefect deploy --all`
                client.read_deployment_by_name(f"data-to-model/{spec['name']}")
