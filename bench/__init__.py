"""onceonly's benchmarks (BENCH.md W1, W2 and W3): ``python -m bench`` runs them all.

Modules: ``workload`` (the shared deterministic W1 calls and W2/W3 state and steps),
``systems`` (onceonly, the stdlib sqlite3/pickle floors, LangGraph + SqliteSaver, DBOS),
``w1``, ``w2`` and ``w3`` (one phase per process), ``runner`` (the orchestrator),
``summary`` and ``report`` (figures, ratios, docs/performance.md and its plots).
"""
