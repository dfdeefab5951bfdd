"""Billing: versioned model prices, the cost of a settled request, and the admin routes for prices and exports."""
