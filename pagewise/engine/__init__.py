"""The inference engine: paged KV cache, scheduler, model runner. No HTTP, no database."""
