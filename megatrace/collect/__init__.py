"""Stage 2, collection: gather every node's rings into the job directory (see issue "Slurm end to end")."""
