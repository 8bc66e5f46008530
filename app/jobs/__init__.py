"""Training jobs, app side: submitting and reading jobs, their event streams, and dataset uploads."""
