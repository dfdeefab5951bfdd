"""Persisted requests: the store that writes their rows, and the asynchronous `/v1/requests` API."""
