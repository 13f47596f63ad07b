"""Cited failure rates, restart time and storage bandwidth for `minigpt simulate --campaign`. Torch-free.

Failure rates are failures per 1000 server-days (8-GPU servers), by cause, each preset from one published study:
  rsc-1        Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters", HPCA
               2025 (arXiv 2410.21680): Meta's RSC-1, 16k A100s in 8-GPU servers, 11 months; the jobs of over 128
               GPUs that ended in a node failure (or failed with a critical health check), per 1000 node-days:
               6.50 (the paper's ETTR section: "RSC-1 failure rate either needs to improve from 6.50 to ~1"). Its
               MTTF model, (servers x rate)^-1, gives the paper's projections (1.8 h at 16,384 GPUs). The paper
               gives no split by cause in its text (its Fig. 4 plots them): one cause here.
  rsc-2        the same study's RSC-2 (8k A100s, vision work): 2.34.
  llama3-405b  Dubey et al., "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 5: the 419 unexpected
               interruptions of a 54-day snapshot on 16K H100s (2,048 servers), by the table's categories, per
               1000 server-days (count / (2,048 x 54) x 1000). These are that run's own outcome: use them for
               other jobs on such a cluster, never to check a prediction of that run (docs/results.md uses the
               RSC presets for it).
Restart (RESTART_S): 10 minutes, from detection to training again: Kokolis et al. give u0 ~ 5-20 min of restart
overhead on the RSC clusters (their ETTR section) and assume 5 min in their Fig. 10; MegaScale (Jiang et al., NSDI
2024, arXiv 2402.15627, section 6.3) detects and diagnoses a failure in under 10 minutes.
Storage (STORAGE_GB_S): 1.0 GB/s of checkpoint writes per server: Llama 3's storage sustains 2 TB/s (Dubey et al.
section 3.3.1, "a sustainable throughput of 2 TB/s and a peak throughput of 7 TB/s") for the 2,048 servers of its
16K GPUs, 0.98 GB/s each when all write at once.
Both are per server of SERVER_GPUS GPUs, the studies' own: a campaign counts its GPUs in such servers whatever
--gpus-per-node says of the cluster's NVLink domains (a GB200 NVL72 rack is 72 GPUs in one domain, in 4-GPU trays).
"""

from __future__ import annotations

import json
from pathlib import Path

from minigpt.errors import ConfigError
from simulator.campaign.model import FailureRates

LLAMA3_SERVER_DAYS = 2048 * 54 / 1000  # thousands of server-days of the 54-day snapshot
LLAMA3_TABLE5 = {  # Table 5's counts by its categories (GPU: faulty GPU 148, HBM3 72, SRAM 19, system processor 17,
    "GPU": 148 + 72 + 19 + 17 + 6 + 6,  # silent data corruption 6, thermal interface and sensor 6)
    "software (dependency)": 54 + 2,
    "network switch and cable": 35,
    "unplanned host maintenance": 32,
    "host (NIC, SSD, power, chassis, IO board, CPU, memory)": 7 + 3 + 3 + 2 + 2 + 2 + 2,
    "unknown (NCCL watchdog timeouts)": 7,
}
PRESETS = {
    "rsc-1": FailureRates({"all causes": 6.50}, "rsc-1: Kokolis et al. 2025 (HPCA), Meta's RSC-1, 16k A100"),
    "rsc-2": FailureRates({"all causes": 2.34}, "rsc-2: Kokolis et al. 2025 (HPCA), Meta's RSC-2, 8k A100"),
    "llama3-405b": FailureRates({cause: count / LLAMA3_SERVER_DAYS for cause, count in LLAMA3_TABLE5.items()},
                                "llama3-405b: Dubey et al. 2024, Table 5, 54 days on 16K H100"),
}
DEFAULT = "rsc-1"
RESTART_S = 600.0  # Kokolis et al. 2025: 5-20 min; MegaScale: detection under 10 min
STORAGE_GB_S = 1.0  # Llama 3: 2 TB/s sustained over its 2,048 servers
SERVER_GPUS = 8  # the servers these rates and this bandwidth are per (RSC-1/2, Llama 3: 8-GPU servers)


def read_rates(value: str | None) -> FailureRates:
    """A preset's rates (None: DEFAULT), or a JSON file's {"cause": failures per 1000 server-days}."""
    if value is None or value in PRESETS:
        return PRESETS[value or DEFAULT]
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"--failure-rates {value}: neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--failure-rates {value}: not a JSON file of rates ({error})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"--failure-rates {value}: give an object {{\"cause\": failures per 1000 server-days}}")
    return FailureRates(dict(data), f"{path.name}")
