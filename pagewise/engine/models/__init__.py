"""Model implementations written against ``pagewise.kernels``."""
