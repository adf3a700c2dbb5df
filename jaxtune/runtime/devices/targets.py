"""Accelerators a run can be planned for on a machine that has none: compile-only devices.

libtpu compiles for any TPU slice without the chips (`jax.experimental.topologies`), so the
train step's XLA:TPU memory plan, the one a rented chip would run, is known before the chip is.
A target is named as users name slices (`v5e-8`: eight v5e chips), or by a raw libtpu topology
(`v5e:2x4`). JAX's CUDA plugin does the same for NVIDIA GPUs (`h100`, `h100-8`: eight on one
host), given the GPU's description (`GpuSpec`) and CUDA's `ptxas` to assemble its kernels.

The figures per device are:
- `hbm`: the memory XLA:TPU lets a program use, as libtpu's out-of-memory message states it
  for that chip (less than the chip's nominal HBM, which the runtime keeps part of);
- `peak_flops` and `hbm_bandwidth`: the vendor's published peak bf16 FLOP/s and HBM bandwidth
  (https://cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e), for a roofline bound and nothing more.

A v4 or v5p slice is named by TensorCores (`v5p-8`: 4 chips). v5p fuses a chip's two cores into
one device (megacore); v4's topologies list each core as a device of its own, with half the chip.

A GPU's `hbm` is the share of its memory JAX's allocator takes, 75% unless
XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (what a run on that GPU could use); its
figures are NVIDIA's datasheets' (SXM parts). A compile-only GPU counts no flops, so GPU plans
give no roofline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from dataclasses import dataclass, field

from jaxtune.errors import TargetError
from jaxtune.host.environment import temporary_environment

GiB = 2**30
TPU_PLAN_EXTRA = "pip install 'jaxtune[tpu-plan]'"
GPU_PLAN_EXTRA = "pip install 'jaxtune[gpu-plan]'"
MiB = 2**20
JAX_GPU_MEMORY_SHARE = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default


@dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler needs to know of a GPU it cannot query (its GpuDeviceInfoProto)."""

    name: str  # the device kind CUDA reports
    compute_capability: tuple[int, int]
    sms: int
    memory: int  # bytes of device memory
    clock_ghz: float  # boost clock
    l2_bytes: int
    shared_per_sm: int
    shared_per_block_optin: int

    def target_config(self, bandwidth: float) -> str:
        """The GpuTargetConfigProto text JAX's CUDA plugin compiles for."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory}
  shared_memory_per_block_optin: {self.shared_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
device_description_str: "{self.name}"
"""


@dataclass(frozen=True)
class Chip:
    kind: str  # libtpu's topology prefix
    hbm: int  # bytes a program may use on one device
    peak_flops: float  # bf16 FLOP/s of one device
    hbm_bandwidth: float  # bytes/s of one device
    cores_per_name: int  # what the N of a name `kind-N` counts per chip: 1 (chips) or 2 (TensorCores)
    devices_per_chip: int = 1
    gpu: GpuSpec | None = None  # None for a TPU

    @property
    def compiler(self) -> str:
        return "XLA:GPU" if self.gpu else "XLA:TPU"


CHIPS = {
    "v5e": Chip("v5e", int(15.75 * GiB), 197e12, 819e9, 1),
    "v6e": Chip("v6e", int(31.25 * GiB), 918e12, 1640e9, 1),
    "v5p": Chip("v5p", int(95.74 * GiB), 459e12, 2765e9, 2),
    "v4": Chip(
        "v4", int(15.25 * GiB), 137.5e12, 614e9, 2, devices_per_chip=2
    ),  # one of a chip's two cores: half of 275 TFLOP/s, 1228 GB/s
}


def _gpu(kind: str, spec: GpuSpec, peak_flops: float, bandwidth: float) -> Chip:
    return Chip(kind, int(spec.memory * JAX_GPU_MEMORY_SHARE), peak_flops, bandwidth, 1, gpu=spec)


GPUS = {  # dense bf16 FLOP/s; HBM bytes/s; device memory as nvidia-smi reports it
    "h100": _gpu(
        "h100",
        GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 81559 * MiB, 1.98, 50 * MiB, 233472, 232448),
        989e12,
        3.35e12,
    ),
    "h200": _gpu(
        "h200", GpuSpec("NVIDIA H200", (9, 0), 132, 143771 * MiB, 1.98, 50 * MiB, 233472, 232448), 989e12, 4.8e12
    ),
    "a100": _gpu(
        "a100",
        GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 81920 * MiB, 1.41, 40 * MiB, 167936, 166912),
        312e12,
        2.039e12,
    ),
}
GPUS_PER_HOST = (1, 2, 4, 8)
# The slice shapes libtpu accepts for each chip count: 2D tori for v5e/v6e, 3D for v4/v5p.
SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
KNOWN = (
    "v5e-1",
    "v5e-4",
    "v5e-8",
    "v5e-16",
    "v6e-1",
    "v6e-4",
    "v6e-8",
    "v6e-16",
    "v5p-8",
    "v5p-16",
    "v5p-32",
    "v4-8",
    "v4-16",
    "v4-32",
    "h100",
    "h100-8",
    "h200",
    "h200-8",
    "a100",
    "a100-8",
)


@dataclass(frozen=True)
class Target:
    name: str  # as the user gave it
    chip: Chip
    topology: str  # libtpu's name, "v5e:2x4"
    options: dict = field(default_factory=dict, hash=False)  # what a single chip needs besides its name

    def describe(self, devices: int) -> str:
        if self.chip.gpu:
            return f"{self.name} ({devices} x {self.chip.gpu.name}, {self.chip.hbm / GiB:.2f} GiB each to JAX)"
        return f"{self.name} (TPU {self.chip.kind}, topology {self.topology}, {devices} device{'s' * (devices != 1)})"


def resolve(name: str) -> Target:
    """The target `name` stands for; TargetError, listing the known names, when it is none."""
    text = name.strip().lower()
    raw = re.fullmatch(r"(v5e|v6e|v5p|v5|v4):(\d+(?:x\d+){1,2})", text)
    if raw:
        kind, shape = ("v5p" if raw[1] == "v5" else raw[1]), raw[2]
        if (len(shape.split("x")) == 2) == (kind in ("v5e", "v6e")):
            return Target(name, CHIPS[kind], f"{kind}:{shape}", _single_chip(shape))
    gpu = re.fullmatch(r"(h100|h200|a100)(?:-(\d+))?", text)
    if gpu and int(gpu[2] or 1) in GPUS_PER_HOST:
        chip = _memory_share(GPUS[gpu[1]])
        return Target(
            name, chip, f"1x1x{int(gpu[2] or 1)}", {"target_config": chip.gpu.target_config(chip.hbm_bandwidth)}
        )
    named = re.fullmatch(r"(v5e|v6e|v5p|v4)-(\d+)", text)
    if named:
        chip = CHIPS[named[1]]
        count, rest = divmod(int(named[2]), chip.cores_per_name)
        shape = (SHAPES_2D if chip.kind in ("v5e", "v6e") else SHAPES_3D).get(count)
        if shape and not rest:
            return Target(name, chip, f"{chip.kind}:{shape}", _single_chip(shape))
    raise TargetError(
        f"unknown target {name!r}: use one of {', '.join(KNOWN)}, or a TPU topology such as "
        "v5e:2x4, v6e:4x4 or v5p:2x2x2 (GPUs: 1, 2, 4 or 8 on one host, as h100-4)"
    )


def _memory_share(chip: Chip) -> Chip:
    """The GPU with the share of its memory this environment's JAX would take."""
    share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_MEMORY_SHARE))
    return dataclasses.replace(chip, hbm=int(chip.gpu.memory * share))


def larger_slices(target: Target, devices: int) -> list[str]:
    """Names of the slices of the target's chip with more devices than `devices`, smallest first."""
    chip = target.chip
    if chip.gpu:
        return [f"{chip.kind}-{count}" for count in GPUS_PER_HOST if count > devices]
    counts = sorted(SHAPES_2D if chip.kind in ("v5e", "v6e") else SHAPES_3D)  # chips in a slice
    return [f"{chip.kind}-{chips * chip.cores_per_name}" for chips in counts if chips * chip.devices_per_chip > devices]


def _single_chip(shape: str) -> dict:
    """What libtpu needs besides a one-chip topology's name (it would otherwise look for a host)."""
    if set(shape.split("x")) != {"1"}:
        return {}
    return {"chip_config_name": "default", "chips_per_host_bounds": (1, 1, 1), "wrap": (False, False, False)}


def devices(target: Target) -> list:
    """The target's compile-only devices. TargetError naming the extra to install when libtpu is missing."""
    from jax.experimental import topologies

    if target.chip.gpu:
        return _gpu_devices(target)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise TargetError(
            f"planning for {target.name} needs libtpu, which is not installed: {TPU_PLAN_EXTRA}"
        ) from None
    with _no_host_lookup():
        return list(
            topologies.get_topology_desc(platform="tpu", topology_name=target.topology, **target.options).devices
        )


def _gpu_devices(target: Target) -> list:
    from jax.experimental import topologies

    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        raise TargetError(
            f"planning for {target.name} needs JAX's CUDA plugin, which is not installed: {GPU_PLAN_EXTRA}"
        ) from None
    if not _ptxas():
        raise TargetError(
            f"planning for {target.name} needs CUDA's ptxas, found neither on PATH nor in the "
            f"nvidia-cuda-nvcc package: {GPU_PLAN_EXTRA}"
        )
    return list(topologies.get_topology_desc(platform="cuda", topology=target.topology, **target.options).devices)


def _ptxas() -> str | None:
    """Where XLA will find ptxas: the nvidia-cuda-nvcc wheel's (what the plugin looks in first), else PATH's."""
    import shutil

    try:
        import nvidia.cu13  # the wheel's namespace package

        for folder in nvidia.cu13.__path__:
            if os.access(os.path.join(folder, "bin", "ptxas"), os.X_OK):
                return os.path.join(folder, "bin", "ptxas")
    except ImportError:
        pass
    return shutil.which("ptxas")


@contextlib.contextmanager
def _no_host_lookup():
    """libtpu looks for the TPU VM it runs on, and off one prints a page of warnings about it;
    naming a host for it stops that. It also takes /tmp/libtpu_lockfile, so that two processes
    never drive one chip, which would keep a second plan from compiling while a first one does:
    compile-only devices drive no chip. A real TPU VM's own settings are kept."""
    settings = {
        "TPU_ACCELERATOR_TYPE": "v5litepod-1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    with temporary_environment({key: os.environ.get(key, value) for key, value in settings.items()}):
        yield
