"""Persistence: SQLAlchemy 2 async models, the session factory and the Alembic runner."""
