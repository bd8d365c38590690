"""onceonly's benchmarks (BENCH.md W2 and W3): ``python -m bench`` runs them all.

Modules: ``workload`` (the shared deterministic state and steps), ``systems`` (onceonly,
the stdlib sqlite3/pickle floors, LangGraph + SqliteSaver), ``w2`` and ``w3`` (one phase
per process), ``runner`` (the orchestrator), ``summary`` and ``report`` (figures, ratios,
docs/performance.md and its plots).
"""
