"""OpenAI's Files API for batch input: upload, list, read, delete — tenant-scoped, size- and line-limited."""
