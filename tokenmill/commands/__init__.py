"""Command groups of the `tokenmill` CLI; each module has `register(subparsers)`."""
