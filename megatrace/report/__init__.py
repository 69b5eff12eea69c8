"""Stage 4, the post-mortem report."""
