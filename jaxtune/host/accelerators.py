"""Whether this machine has an accelerator JAX could use, told from its device files alone.

JAX's TPU and CUDA plugins, once installed (the tpu-plan and gpu-plan extras install them, and
`make test` both), start with JAX's first backend, and on a machine without their device print
about 25 lines of tracebacks ("Unable to load cuDNN") and libtpu warnings (TPU_ACCELERATOR_TYPE,
TPU_WORKER_HOSTNAMES) before jaxtune's own. Where neither a TPU (/dev/accel*, /dev/vfio/<group>)
nor an NVIDIA GPU (/dev/nvidia<N>) is present, importing jaxtune sets JAX_PLATFORMS=cpu, unless
the environment has chosen JAX's platforms already. Plans for chips this machine lacks
(`jaxtune doctor --target`) are unaffected: they compile for compile-only devices, which JAX's
platforms do not govern.
"""

from __future__ import annotations

import glob
import os

DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")


def present() -> bool:
    """Whether a TPU or an NVIDIA GPU shows a device file here."""
    return any(glob.glob(pattern) for pattern in DEVICE_FILES)


def cpu_without_accelerators() -> None:
    """JAX_PLATFORMS=cpu where no accelerator is present and the environment sets none."""
    if "JAX_PLATFORMS" not in os.environ and not present():
        os.environ["JAX_PLATFORMS"] = "cpu"
