"""A whole training campaign: weeks of steps on a cluster whose parts fail, with checkpoints and restarts. Torch-free.

model.py the inputs (the step, the cluster's failure rates by cause, checkpoint and restart costs) and their checks;
run.py the SimPy simulation (training interrupted by failures, replicated over seeds) and its results;
interval.py the checkpoint interval that maximises goodput, against Young's and Daly's formulas.
"""
