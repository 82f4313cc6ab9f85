"""Shared fixtures: a real PostgreSQL server for the store tests (started once per session)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from benchmarks.postgres_server import PostgresServer
from decentrl.pgsql import PostgresUnavailable


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway server (initdb + pg_ctl, as the postgres user under root); skipped with the
    reason where PostgreSQL or psycopg is missing (`make test` installs both)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'decentrl[postgres]'")
    try:
        server = PostgresServer().start()
    except PostgresUnavailable as error:
        pytest.skip(str(error))
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """A fresh, empty database on the session's server: one run's store."""
    import psycopg

    name = f"run_{secrets.token_hex(6)}"
    with psycopg.connect(postgres_server.url, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return postgres_server.url.rsplit("/", 1)[0] + f"/{name}"
