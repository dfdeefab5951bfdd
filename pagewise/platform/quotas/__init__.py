"""Per-tenant quotas: one `QuotaStore` interface; an in-process and a Redis store with equal semantics."""
