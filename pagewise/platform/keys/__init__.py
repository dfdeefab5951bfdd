"""API keys: generation, hashing, verification, the auth middleware, scope guards and admin routes."""
