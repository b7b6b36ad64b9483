"""The ground every app stands on: storage, downloads, outbound endpoint checks, the secrets box,
the API's base helpers (fields, pagination, parsers, permissions, throttling), websocket
authentication and environment parsing.

It imports no app of the project (accounts, notifications, jobs, billing, scheduler) and not the
project (e31web): import-linter's layers contract in pyproject.toml keeps it so. It is not a
Django app (no models, no migrations).
"""
