"""Code that runs inside the training workers: process-group start-up, rank agreement, preflight."""
