"""Many simulations: sweeps over GPU counts (sweep) and the layout search (plan, pruned by bound).
Imports the engine and everything below it."""
