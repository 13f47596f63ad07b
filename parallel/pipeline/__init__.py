"""Pipeline parallelism: the model cut into chunks and the executor of job/schedule.py's actions (executor), with
zero-bubble's deferred weight gradients (weight_gradients). Imports the shared pieces only."""
