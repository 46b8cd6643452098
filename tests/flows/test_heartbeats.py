"""flows/runtime/settings.py: flow runs send heartbeats to a configured Prefect server, none to the temporary one."""

from __future__ import annotations

from prefect.settings import get_current_settings

from flows.runtime.settings import heartbeats_unless_temporary


def heartbeat_seconds() -> int | None:
    """What Prefect's flow engine reads (``BaseFlowRunEngine.heartbeat_seconds``): None sends none."""
    return get_current_settings().flows.heartbeat_frequency


def test_no_heartbeats_to_the_temporary_server_and_prefects_own_setting_elsewhere() -> None:
    configured = heartbeat_seconds()
    assert configured is not None
    with heartbeats_unless_temporary(True):
        assert heartbeat_seconds() is None  # nothing could watch them: the server stops with the command
    assert heartbeat_seconds() == configured
    with heartbeats_unless_temporary(False):
        assert heartbeat_seconds() == configured  # a server's automation may mark a silent run crashed
