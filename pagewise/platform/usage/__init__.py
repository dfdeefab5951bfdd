"""Usage: daily (and hourly) token and request counts per tenant and model."""
