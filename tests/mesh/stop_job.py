"""One process of a two-process JAX job on the CPU (started by test_stop_job.py): a loop of steps
that asks `jaxtune.host.stopping` after each whether to stop, as training does. Process 1 sends itself
SIGTERM during step `AT` and is the slower one, so process 0 always reaches each step first."""

from __future__ import annotations

import os
import signal
import sys
import time

from jaxtune.config import MeshConfig
from jaxtune.host import processes, stopping

AT = 5


def main(index: int, port: int) -> None:
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(index))
    processes.join(MeshConfig())
    with stopping.stop_on_signals(None) as stops:
        for step in range(1, 100):
            if index == 1:
                time.sleep(0.05)
                if step == AT:
                    os.kill(os.getpid(), signal.SIGTERM)
            stop, _ = stops.after_step()
            if stop:
                print(f"process {index} stopped at step {step} by {stops.signal}", flush=True)
                return
    print(f"process {index} never stopped", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
