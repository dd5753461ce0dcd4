"""Fixtures of the CUDA tests: the integration tests' ``job_env`` (a job subprocess's own
SPECLAB_HOME and SQLite MLflow store), re-exported for the jobs run on a GPU here."""

from tests.integration.conftest import job_env  # noqa: F401  (a fixture)
