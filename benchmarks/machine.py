"""What a benchmark's figures depend on besides its settings: the machine and its load."""

import os


def load_note():
    """The load average (1, 5, 15 minutes) and the core count, to store with the figures:
    the benchmarks share the cores with whatever else runs, and their rates follow it."""
    return {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count()}
