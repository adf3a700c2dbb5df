"""The machine jaxtune runs on and the processes on it: whether it has an accelerator
(`accelerators`), environment variables set for a block (`environment`), this process's place in
a multi-host job (`processes`) and the job's launch (`launch`), stopping on a signal (`stopping`),
and the temporary Prefect server a run starts (`temporary_server`). Nothing here imports JAX at
import time.

May import: jaxtune.config, jaxtune.errors
"""
