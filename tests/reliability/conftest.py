"""Reliability tests use the web fixtures: PostgreSQL, the test Redis, a real worker."""

from tests.web.conftest import *  # noqa: F401,F403
