"""The `minigpt` command line (click): main registers the commands of commands/, which read their flags
through options/ and call tools/ (compare, the memory check) and claims/ (the seed article's claims); output
and output_file format what they print and check where they write."""
