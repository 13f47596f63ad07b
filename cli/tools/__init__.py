"""Tools that need both interpreters (the executor in parallel/ and the simulator in simulator/), so
they sit above both: compare trains a layout and simulates it, side by side; memory_check prices a run's
memory with the simulator before training starts; plots draws the commands' pictures (simulate's step, plan's
layouts, compare's phases)."""
