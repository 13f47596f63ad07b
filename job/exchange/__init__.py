"""What the compute actions of the schedule exchange inside them: context parallelism's keys and values
(context.py), expert parallelism's routed tokens (experts.py). Torch-free."""
