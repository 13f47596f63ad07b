"""Data parallelism: the wrapper protocol the executor and step call, and ZeRO stages 0-3 (zero, zero3).
Imports the shared pieces (comm) only."""
