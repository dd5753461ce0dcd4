"""Fixtures of the CUDA tests: the integration tests' ``job_env`` (a job subprocess's own
SPECLAB_HOME and SQLite MLflow store), re-exported for the jobs run on a GPU here.

With ``SPECLAB_TEST_LOG`` set (``make gpu-report`` sets it), every test's outcome is
appended to that JSON-lines file as soon as it is known (with pytest-xdist, by the
controlling process), so a session that hangs or is stopped still leaves its results:
``{"collected": n}`` once, then ``{"test", "outcome", "seconds", "error"}`` per test."""

import json
import os

import pytest

from tests.integration.conftest import job_env  # noqa: F401  (a fixture)

#: whether this process is a pytest-xdist worker (its controller writes the log); read
#: from the process's own config, not the environment, which a pytest started from a
#: worker (a test running pytest) inherits
_WORKER = {"is": False}


def pytest_configure(config) -> None:
    _WORKER["is"] = hasattr(config, "workerinput")


def _log(record: dict) -> None:
    path = os.environ.get("SPECLAB_TEST_LOG")
    if path and not _WORKER["is"]:  # the controller writes
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    _log({"collected": len(session.items)})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """With pytest-xdist the controller collects nothing: the first worker's count."""
    path = os.environ.get("SPECLAB_TEST_LOG")
    if path and node.gateway.id == "gw0":
        _log({"collected": len(ids)})


def pytest_runtest_logreport(report) -> None:
    """One line per test: its call's outcome, or a failing or skipping setup / teardown."""
    if report.when == "call" or report.outcome != "passed":
        _log({"test": report.nodeid, "phase": report.when,
              "outcome": {"failed": "error" if report.when != "call" else "failed"}.get(
                  report.outcome, report.outcome),
              "seconds": round(report.duration, 2),
              "error": report.longreprtext[-4000:] if report.failed else None})
