"""The SQL connection a coordinator store's transaction yields, shared with the record writers.

`sqlite3.Connection` meets it as it is; the PostgreSQL store's shim (`coordinator/db/postgres.py`)
meets it by translating `?` placeholders. Code that takes a transaction's connection types it as
`Connection`, so neither backend is cast to the other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol


class Cursor(Protocol):
    """A statement's result: rows readable by index and by column name."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What a transaction yields: `sqlite3.Connection`'s `execute`/`executemany` with `?`
    parameters, which `Store` gives as they are and `postgres.Connection` translates."""

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]], /) -> Cursor: ...
