"""Background jobs (Celery on the Redis broker): usage checks, monthly billing exports, retention.

Jobs use a synchronous SQLAlchemy engine (psycopg or pysqlite) rather than driving asyncio inside Celery.
Importing this package loads neither torch nor Celery; `pagewise.jobs.celery_app` loads Celery.
"""
