"""Admin views for a dashboard: usage across tenants, request search, live engine stats, an overview."""
