"""onceonly ledger layer (built in later issues)."""

__all__: list[str] = []
