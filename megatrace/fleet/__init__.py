"""The inspection loop around the jobs: periodic node health checks, their history, and alerts."""
