"""The job description both interpreters stand on, torch-free: a run's settings (train_config), what
every rank does in a step (the schedule and its actions, checks, drawing and symbolic run), and the
trace format both write. parallel/ executes it with torch; simulator/ replays it with SimPy."""
