"""onceonly's benchmarks, W1 to W4 (targets in bench/summary.py): ``python -m bench`` runs them.

Modules: ``workload`` (the shared deterministic W1 calls and W2/W3 state and steps),
``systems`` (onceonly, the stdlib sqlite3/pickle floors, LangGraph + SqliteSaver, DBOS),
``w1``, ``w2`` and ``w3`` (one phase per process), ``runner`` (the orchestrator),
``summary`` and ``report`` (figures, ratios, docs/performance.md and its plots).
"""
