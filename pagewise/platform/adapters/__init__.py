"""Tenants ' LoRA adapters: upload, validation, storage, listing, and resolving `<base>:<adapter>` model names."""
