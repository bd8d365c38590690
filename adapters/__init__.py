"""onceonly adapters layer (built in later issues)."""

__all__: list[str] = []
