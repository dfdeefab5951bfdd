"""The Litestar service: tenants, API keys, quotas, persisted requests and the OpenAI-compatible API."""
