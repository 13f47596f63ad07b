"""One module per `minigpt` command (cli/main.py imports each on first use): each parses its flags and calls
parallel/, simulator/ or cli/tools and cli/claims."""
