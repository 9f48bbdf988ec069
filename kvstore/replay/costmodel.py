"""The cost model of the simulated inference engines, stated plainly.

Nothing here is measured; every number is a model input or follows from one.

* **Prefill** (compute-bound): ``2 x params x tokens / (gpus x FLOP/s x MFU)``
  for the tokens that are not cached (linear in tokens: the attention term is
  left out, which flatters long prompts the same for every policy).
* **Decode** (memory-bound): each output token reads the weights and the
  request's KV once: ``(params x dtype_bytes + kv_bytes_per_token x context)
  / (gpus x HBM bytes/s)`` per token, with the context at its mid-point.
* **Page bytes**: ``layers x kv_heads x head_dim x 2 (K and V) x dtype_bytes
  x block_tokens``. Llama-3-8B with 512-token Mooncake blocks: 64 MiB.
  ``--byte-scale`` divides this for the bytes that really move through the
  store on this machine; modelled transfer times use the unscaled bytes.
* **Link** (the stated network for modelled transfers): ``unscaled bytes /
  link bytes/s``, 50 GB/s by default (one 400 Gb/s RDMA NIC).
* **Local load** of a cached page into the engine: ``unscaled bytes / HBM
  bytes/s`` (a pool on the same GPU), or over each GPU's PCIe link (a host
  pool, the replay's default).
* **Disk load** of a page the node's disk tier holds: ``unscaled bytes / the
  node's NVMe read bytes/s``, then the local load.

A node's storage (``--capacity preset``, ``--tier-policies tiers-*``) is a DGX H100's
share per GPU (NVIDIA's DGX H100/H200 specifications: 8 GPUs, 2 TB DDR5,
eight 3.84 TB U.2 NVMe drives for data and cache): host memory for KV is half
of each GPU's 250 GB (the rest is the OS's, the engine processes' and pinned
staging), 125 GB; one 3.84 TB drive a GPU, at a PCIe Gen4 U.2 data-center
drive's rated sequential 6.4 GB/s read and 3.8 GB/s write, 1 drive write per
day (Samsung PM1733 U.2). ``llama3-70b-tp8``: 1 TB host, 30.7 TB NVMe at
51.2 / 30.4 GB/s.

Presets (H100 SXM class: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, MFU 0.5):

| preset | model | layers | kv heads | head dim | params | GPUs (TP) | page (512 tok) |
|---|---|---|---|---|---|---|---|
| ``llama3-8b`` | Llama-3-8B | 32 | 8 | 128 | 8.03e9 | 1 | 64 MiB |
| ``llama3-70b`` | Llama-3-70B | 80 | 8 | 128 | 70.6e9 | 4 | 160 MiB |
| ``llama3-70b-tp8`` | Llama-3-70B | 80 | 8 | 128 | 70.6e9 | 8 | 160 MiB |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

BLOCK_TOKENS = 512  # Mooncake traces hash 512-token blocks
MIN_PAGE_BYTES = 4096
MODELLED_CAPACITY = 1 << 40  # --capacity auto: each node holds this many modelled bytes (real = this / byte scale)


def auto_byte_scale(page_bytes: int) -> int:
    """``--byte-scale auto``: the largest scale that stores a page of ``page_bytes`` in whole 8-byte words
    of at least :data:`MIN_PAGE_BYTES` (4 KiB for every preset). The harness moves the stored bytes through
    one Python process for all engines on this machine's cores, a cost no fleet pays (its engines move KV
    by DMA, one machine each); the smallest stored page keeps that cost off the replay's clock while every
    page still carries its own verifiable bytes."""
    for stored in range(MIN_PAGE_BYTES, page_bytes + 1, 8):
        if page_bytes % stored == 0:
            return page_bytes // stored
    raise ValueError(f"a page of {page_bytes} B cannot be stored in 8-byte words of at least {MIN_PAGE_BYTES} B")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder-only model's size and KV shape."""

    name: str
    params: float          # parameters
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2   # bf16 weights and KV

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Hardware:
    """One GPU's peak numbers, the MFU prefill reaches, and the inter-node link."""

    name: str
    flops: float           # dense bf16 FLOP/s per GPU
    hbm_bytes_s: float     # HBM bytes/s per GPU
    mfu: float = 0.5
    link_bytes_s: float = 50e9   # node-to-node link for modelled transfers
    pcie_bytes_s: float = 55e9   # host memory -> one GPU (PCIe Gen5 x16, achievable)
    hbm_bytes: float = 80e9      # HBM per GPU (H100 SXM: 80 GB)
    # a DGX H100's storage per GPU (module doc): host memory for KV, one U.2 NVMe drive
    host_kv_bytes: float = 125e9
    nvme_bytes: float = 3.84e12
    nvme_read_bytes_s: float = 6.4e9
    nvme_write_bytes_s: float = 3.8e9
    nvme_dwpd: float = 1.0       # rated drive writes per day (endurance)


H100 = Hardware("H100-SXM", flops=989e12, hbm_bytes_s=3.35e12)
GPU_MEMORY_UTILIZATION = 0.9  # the share of HBM an engine takes (vLLM's --gpu-memory-utilization default)

# --link presets: (bytes/s per node and direction, one-way latency s)
LINKS: dict[str, tuple[float, float]] = {
    "eth-100g": (12.5e9, 10e-6),      # one 100 GbE NIC a node
    "rdma-400g": (50e9, 5e-6),        # one 400 Gb/s RDMA NIC
    "rdma-8x400g": (400e9, 5e-6),     # a DGX-class node: eight 400 Gb/s NICs
}
LLAMA3_8B = ModelShape("Llama-3-8B", params=8.03e9, layers=32, kv_heads=8, head_dim=128)
LLAMA3_70B = ModelShape("Llama-3-70B", params=70.6e9, layers=80, kv_heads=8, head_dim=128)

# preset name -> (model, GPUs per engine with tensor parallelism, hardware)
PRESETS: dict[str, tuple[ModelShape, int, Hardware]] = {
    "llama3-8b": (LLAMA3_8B, 1, H100),
    "llama3-70b": (LLAMA3_70B, 4, H100),
    "llama3-70b-tp8": (LLAMA3_70B, 8, H100),
}


@dataclass(frozen=True, slots=True)
class CostModel:
    """Modelled times (seconds, unscaled) and page sizes for one engine."""

    model: ModelShape
    gpus: int
    hw: Hardware
    block_tokens: int = BLOCK_TOKENS
    byte_scale: int = 4096
    pool_medium: str = "host"     # where the node's pool lives: host (loaded over PCIe) or hbm

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.byte_scale < 1 or self.block_tokens < 1:
            raise ValueError("gpus, byte_scale and block_tokens must be >= 1")
        if self.pool_medium not in ("host", "hbm"):
            raise ValueError("pool medium must be host or hbm")
        if not 0 < self.hw.mfu <= 1:
            raise ValueError("mfu must be in (0, 1]")
        scaled = self.page_bytes / self.byte_scale
        if scaled != int(scaled) or int(scaled) % 8 or scaled < MIN_PAGE_BYTES:
            raise ValueError(f"--byte-scale {self.byte_scale}: page {self.page_bytes} B / scale = {scaled:g} B; "
                             f"it must be a whole multiple of 8 and >= {MIN_PAGE_BYTES} B")

    @classmethod
    def preset(cls, name: str, byte_scale: int = 4096, mfu: float | None = None,
               link_gbs: float | None = None, block_tokens: int = BLOCK_TOKENS,
               pool_medium: str = "host") -> "CostModel":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        model, gpus, hw = PRESETS[name]
        if mfu is not None:
            hw = replace(hw, mfu=mfu)
        if link_gbs is not None:
            hw = replace(hw, link_bytes_s=link_gbs * 1e9)
        return cls(model, gpus, hw, block_tokens, byte_scale, pool_medium)

    # ---- bytes -------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Unscaled KV bytes of one block (the modelled size)."""
        return self.model.kv_bytes_per_token * self.block_tokens

    @property
    def engine_cache_blocks(self) -> int:
        """Blocks the engine's own KV cache holds (its prefix cache): the HBM the engine takes
        (:data:`GPU_MEMORY_UTILIZATION`) less the weights, over a block's KV. Llama-3-70B TP8 on H100:
        (8 x 80 GB x 0.9 - 141 GB) / 160 MiB = 2,592 blocks (1.3M tokens)."""
        free = self.gpus * self.hw.hbm_bytes * GPU_MEMORY_UTILIZATION - self.model.weight_bytes
        return max(0, int(free // self.page_bytes))

    @property
    def host_kv_bytes(self) -> int:
        """Host memory a node gives KV (``--capacity preset``: the store's pool), unscaled."""
        return int(self.gpus * self.hw.host_kv_bytes)

    @property
    def nvme_bytes(self) -> int:
        """The node's NVMe for KV (the disk tier below the pool of ``--tier-policies tiers-*``), unscaled."""
        return int(self.gpus * self.hw.nvme_bytes)

    @property
    def nvme_read_bytes_s(self) -> float:
        return self.gpus * self.hw.nvme_read_bytes_s

    @property
    def nvme_write_bytes_s(self) -> float:
        return self.gpus * self.hw.nvme_write_bytes_s

    @property
    def disk_write_budget_bytes_s(self) -> float:
        """The node's rated endurance as a mean write rate: drive writes per day x capacity / a day."""
        return self.hw.nvme_dwpd * self.nvme_bytes / 86400.0

    @property
    def scaled_page_bytes(self) -> int:
        """Bytes of one page as stored and moved on this machine."""
        return self.page_bytes // self.byte_scale

    # ---- times (unscaled seconds) -------------------------------------------
    def prefill_s(self, tokens: int) -> float:
        """Compute-bound prefill of ``tokens`` uncached tokens."""
        return 2.0 * self.model.params * max(0, tokens) / (self.gpus * self.hw.flops * self.hw.mfu)

    def decode_step_s(self, context_tokens: float) -> float:
        """One output token: read the weights and the context's KV from HBM."""
        nbytes = self.model.weight_bytes + self.model.kv_bytes_per_token * max(0.0, context_tokens)
        return nbytes / (self.gpus * self.hw.hbm_bytes_s)

    def decode_s(self, input_tokens: int, output_tokens: int) -> float:
        """All ``output_tokens`` steps (the context grows linearly: use its mid-point)."""
        if output_tokens <= 0:
            return 0.0
        return output_tokens * self.decode_step_s(input_tokens + output_tokens / 2.0)

    def uncached_tokens(self, input_tokens: int, cached_blocks: int) -> int:
        """Tokens left to prefill; at least one (the last token is always computed)."""
        return max(1, input_tokens - cached_blocks * self.block_tokens)

    def link_s(self, blocks: int) -> float:
        """Modelled transfer of ``blocks`` pages (unscaled bytes) over the stated link."""
        return blocks * self.page_bytes / self.hw.link_bytes_s

    def local_load_s(self, blocks: int) -> float:
        """Modelled load of ``blocks`` cached pages from the node's own pool into the engine: HBM for a
        GPU pool, host memory over each GPU's PCIe link for a host pool (each TP rank loads its share)."""
        per_gpu = self.hw.hbm_bytes_s if self.pool_medium == "hbm" else self.hw.pcie_bytes_s
        return blocks * self.page_bytes / (self.gpus * per_gpu)

    def disk_load_s(self, blocks: int) -> float:
        """Modelled read of ``blocks`` pages from the node's disk tier into its pool (the node's drives in
        parallel); the load into the engine (:meth:`local_load_s`) comes on top."""
        return blocks * self.page_bytes / self.nvme_read_bytes_s

    def describe(self) -> dict[str, object]:
        """The model inputs and derived sizes, for results.json."""
        return {"model": asdict(self.model), "gpus": self.gpus, "hardware": asdict(self.hw),
                "block_tokens": self.block_tokens, "byte_scale": self.byte_scale, "pool_medium": self.pool_medium,
                "page_bytes_unscaled": self.page_bytes, "page_bytes_scaled": self.scaled_page_bytes,
                "kv_bytes_per_token": self.model.kv_bytes_per_token,
                "prefill_s_per_block": self.prefill_s(self.block_tokens),
                "link_s_per_block": self.link_s(1), "disk_load_s_per_block": self.disk_load_s(1),
                "host_kv_bytes": self.host_kv_bytes, "nvme_bytes": self.nvme_bytes,
                "disk_write_budget_bytes_s": self.disk_write_budget_bytes_s}
