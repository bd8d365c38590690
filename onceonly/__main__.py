"""``python -m onceonly`` runs the command line."""

from .cli import main

main()
