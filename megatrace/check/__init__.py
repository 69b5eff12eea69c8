"""Preflight health probes (GPU, node, network)."""
