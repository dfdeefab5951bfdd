"""Tenants: the customers whose keys, quotas, requests and usage the platform keeps apart."""
