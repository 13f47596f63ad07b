"""The shared core and the simulator must stay torch-free."""

import subprocess
import sys


def test_simulator_and_config_do_not_import_torch():
    code = "import sys, simulator, minigpt.config, job.train_config; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_check_can_fail():
    code = "import sys, minigpt.model; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"
