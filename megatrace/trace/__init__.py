"""Stage 1, capture: the ring-file format, its writer and reader, and the torch.distributed tracer."""
