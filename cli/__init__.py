"""The `minigpt` command line (click)."""
