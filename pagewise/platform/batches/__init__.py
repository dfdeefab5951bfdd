"""OpenAI's Batch API: a tenant's offline requests, run at the batch priority class and billed at the batch rate."""
