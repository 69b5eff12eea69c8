"""Stage 3, analysis: matching, hangs, dependency graph, critical path, stragglers, rules."""
