"""The dashboard's pages, one module per domain; `dashboard/__init__.py` registers them."""
