"""The serving core: the protocol between the API and the engines (`protocol`), the ledgers a request is settled
in, as interfaces (`ledgers`), and the engine's side of serving (`EngineHost`, `Execution`). It imports neither
Litestar, SQLAlchemy nor torch (checked by `lint-imports`): the platform implements the ledgers and speaks HTTP;
the Redis worker and the embedded mode run the same core."""
