"""The row-lease algorithm on SQL servers: a dialect (the SQL text) over a driver (the wire).

``dialect`` holds what differs between PostgreSQL and SQL Server (statements, types,
how a version is decoded); ``asyncpg_driver`` and ``pyodbc_driver`` hold how statements
reach a server; ``store`` joins one of each into a :class:`~sidecar.lease.rowlease.RowStore`,
and ``entry`` makes a whole backend of a dialect and a driver (``postgres_row`` and
``sqlserver`` are one line each).
Keeping them apart lets the pyodbc driver be exercised for real against PostgreSQL
(through psqlODBC) even though no SQL Server can run in CI.

Nothing here imports asyncpg or pyodbc until a driver module is imported.
"""
