"""The OpenAI-compatible API: chat completions, completions (sync and streamed) and models."""
