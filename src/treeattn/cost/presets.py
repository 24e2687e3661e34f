"""Built-in clusters: nominal hardware figures and stated assumptions (see each ``notes``).

``local`` (this kind of machine: CPU ranks, gloo over loopback) is the default of ``auto``
on gloo, ``dgx-h100`` on NCCL, unless a calibrated profile is given
(:mod:`treeattn.cost.profile`).
"""

from __future__ import annotations

import os

from .model import Cluster


def _local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


PRESETS: dict[str, Cluster] = {
    "dgx-h100": Cluster(
        name="dgx-h100",
        nodes=128,
        devices_per_node=8,
        intra_alpha=1e-6,
        intra_beta=450e9,
        inter_alpha=5e-6,
        inter_beta=50e9,
        device_mem_bw=3.35e12,
        attn_efficiency=0.7,
        collective_alpha=8e-6,
        attn_alpha=5e-6,
        allreduce_algo="auto",
        allgather_algo="ring",
        device_mem=80e9,
        notes=(
            "Paper's cluster (seed 000, section 6): DGX H100 nodes, 8 GPUs each, NVLink 4 all-to-all "
            "900 GB/s per GPU = 450 GB/s per direction (used as intra_beta), 8 x 400 Gb/s InfiniBand NDR per "
            "node = one 50 GB/s NIC per GPU per direction (inter_beta); HBM3 3.35 TB/s (H100 SXM datasheet). "
            "The paper used 16 nodes; 128 are modelled so p can reach 1024 with the same per-node hardware. "
            "ASSUMPTIONS (not from the paper): 8 us fixed cost per NCCL call or p2p hop, 1 us per NVLink step, "
            "5 us per InfiniBand step (so an NVLink p2p hop costs 9 us, an IB hop 13 us, an 8-GPU small "
            "all-reduce 22 us); attention at 70% of HBM bandwidth plus 5 us per kernel; NCCL-like algorithm "
            "choice: all-reduce = cheaper of ring and tree, all-gather = ring."
        ),
    ),
    "2x4090-pcie": Cluster(
        name="2x4090-pcie",
        nodes=1,
        devices_per_node=2,
        intra_alpha=5e-6,
        intra_beta=25e9,
        inter_alpha=5e-6,
        inter_beta=25e9,
        device_mem_bw=1.008e12,
        attn_efficiency=0.7,
        collective_alpha=10e-6,
        attn_alpha=5e-6,
        allreduce_algo="auto",
        allgather_algo="ring",
        device_mem=24e9,
        notes=(
            "Two RTX 4090 on one host over PCIe 4.0 x16 (32 GB/s nominal, 25 GB/s effective per direction, "
            "ASSUMED); GDDR6X 1008 GB/s (datasheet). ASSUMPTIONS: 10 us per NCCL call or hop plus 5 us per "
            "step (GeForce cards have no peer-to-peer, NCCL goes through host memory), attention at 70% "
            "of memory bandwidth plus 5 us per kernel."
        ),
    ),
    "local": Cluster(
        name="local",
        nodes=1,
        devices_per_node=64,
        intra_alpha=50e-6,
        intra_beta=2.7e9,
        inter_alpha=50e-6,
        inter_beta=2.7e9,
        device_mem_bw=10e9,
        attn_efficiency=0.6,
        collective_alpha=200e-6,
        attn_alpha=50e-6,
        p2p_alpha=300e-6,
        p2p_beta=2.7e9,
        allreduce_algo="ring",
        allgather_algo="ring",
        compute_slots=_local_cores(),
        notes=(
            "This CPU machine: p processes on one host, gloo over loopback TCP (ring all-reduce and "
            "all-gather). DEFAULTS TO BE REPLACED BY CALIBRATION (--calibrate): 200 us per gloo call + 50 us "
            "per step (about 300 us per all-reduce at p = 2), 2.7 GB/s per loopback stream, 300 us per "
            "send/recv hop, 10 GB/s memory bandwidth per rank at 60% efficiency plus 50 us per attention "
            "call; compute_slots = this machine's usable cores."
        ),
    ),
}

#: Default ``--p`` and ``--seq`` lists of each preset.
PRESET_GRID: dict[str, tuple[list[int], list[int]]] = {
    "dgx-h100": (
        [8, 16, 32, 64, 128, 256, 512, 1024],
        [80_000, 320_000, 1_280_000, 5_120_000, 20_480_000, 100_000_000],
    ),
    "2x4090-pcie": ([1, 2], [8_192, 32_768, 131_072, 524_288, 2_097_152]),
    "local": ([1, 2, 4], [16_384, 65_536, 262_144, 1_048_576]),
}

#: Built-in model ``auto`` uses per process-group backend when no profile is given.
DEFAULT_PRESET: dict[str, str] = {"nccl": "dgx-h100"}
FALLBACK_PRESET = "local"


def default_cluster(backend: str | None = None) -> Cluster:
    """The built-in cluster for a torch.distributed backend (``"local"`` unless NCCL)."""
    return PRESETS[DEFAULT_PRESET.get(backend or "", FALLBACK_PRESET)]
