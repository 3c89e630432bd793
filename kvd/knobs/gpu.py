"""Knobs of the CUDA backend: whether it runs, its copy kernels, staging and copy-engine (DMA) paths.

Part of ``kvd.knobs.KNOBS`` (in this order); types, defaults and help are the contract
(docs/config.md and configs/kvd.toml list the same knobs).
"""

from __future__ import annotations

from kvd.knobs.knob import Knob

KNOBS = (
    Knob("gpu", "str", "auto", "CUDA backend: auto (on when cupy and a GPU are present), on "
         "(fail start-up without them), off.", choices=("auto", "on", "off")),
    Knob("gpu_max_blocks", "int", 32, "Cap on thread blocks of one copy kernel, so copies leave "
         "the engines their SMs.", minimum=1),
    Knob("gpu_stage_slots", "int", 2, "Staging buffers per GPU and direction (copies go pool -> "
         "GPU buffer by kernel, buffer -> host tier by DMA); 0 copies straight to host memory.",
         minimum=0),
    Knob("gpu_stage_slot_bytes", "size", 64 * 2**20, "Bytes of one staging buffer; each GPU that "
         "registers a pool holds 2 x slots x this (256 MiB by default). Staged DMA moves whole "
         "chunks per slot: slots of several chunks cost less host time per byte (DeepSeek-MLA "
         "chunks of 18 MB, one way: 0.72-0.87 of a memcpy with 32 MiB slots, 0.92-0.95 with "
         "64 MiB).", minimum=2**20),
    Knob("gpu_copy_path", "str", "auto", "How GPU copies move pages: dma (the copy engines only, no "
         "kernel of the daemon's; where each page of a layer is one byte range), kernels (SM "
         "copy kernels; fastest on an idle GPU, but without CUDA MPS every kernel of the daemon's "
         "costs the engines their GPU time slices), auto (dma where one copy moves at least "
         "gpu_dma_min_piece bytes, kernels below).", choices=("auto", "dma", "kernels")),
    Knob("gpu_dma_streams", "int", 8, "Streams (and so copy engines) one DMA copy of small "
         "pieces (see gpu_dma_spread_below) is spread over, per GPU and direction.", minimum=1),
    Knob("gpu_dma_spread_below", "size", 64 * 2**10, "DMA copies whose pieces (a page's byte "
         "range, or a pitched op of a page's planes) average under this many bytes are spread "
         "over gpu_dma_streams streams (32 KiB pieces: 0.67-0.75 of a memcpy on 8 streams, "
         "0.38-0.44 on one); larger ones go on one stream, which keeps up with PCIe alone and "
         "costs the event loop one driver call: DeepSeek-MLA pages of 1.1 MB moved at 0.94 / "
         "0.99 / 0.79 of a memcpy (offload / load / both, H100 medians) instead of 0.81 / 0.92 "
         "/ 0.66 spread, and per-layer pages of 72 KiB loaded at 0.92-0.94 instead of 0.86-0.89. "
         "0 = never spread.", minimum=0),
    Knob("gpu_dma_store_thread", "bool", True, "DMA stores are queued with the driver by a "
         "thread of each GPU, not the event loop: per-layer pools (SGLang's) cost ~2,000 rows a "
         "request, 1-2 ms of the loop (MLA pages of 64 stored at 0.95 of a memcpy, not 0.88). Sets "
         "the switch interval to 0.2 ms while it runs. Ignored when gpu_dma_stage_below > 0."),
    Knob("gpu_dma_load_thread", "bool", True, "DMA loads are queued by a thread of each GPU "
         "(beside the stores'), which checks each step's cancel word and the load window and "
         "writes the layer and done words; the loop only plans them (per-layer MLA pages of 64 "
         "at scattered ids: loads 0.97 of a memcpy instead of 0.91, both ways 0.72 instead of "
         "0.61; other pools unchanged). Ignored when gpu_dma_stage_below > 0."),
    Knob("gpu_dma_min_piece", "size", 64 * 2**10, "With gpu_copy_path = auto: the fewest bytes "
         "one DMA copy must move for a pool to go by DMA: a page (one layer and K or V), or, "
         "when a pool's layers share one allocation, a page's rows of all its planes in one "
         "pitched copy (pages of 16 KiB or more, 16 planes or more). Smaller copies are slow "
         "on the copy engines and go through kernels.", minimum=1),
    Knob("gpu_dma_load_window", "size", 256 * 2**20, "Bytes of one GPU's loads queued on its copy "
         "engines at most: a load is queued in steps (a staging slot's chunks; else runs of "
         "pages over all layers, about a quarter of this each; a layer-wise load layer by "
         "layer), each after a check of its cancel word, so after a cancel at most this much "
         "more lands (always before the done word; 256 MiB is about 5 ms of PCIe). Smaller "
         "windows let the copy engines run dry between steps (64 MiB: loads 0.86 of a memcpy "
         "instead of 0.91).", minimum=1),
    Knob("gpu_dma_stage_below", "size", 0, "DMA copies of pages under this many bytes (in "
         "pitched ops of all layers) go through the staging slots: gathered into a slot inside "
         "the GPU, then one DMA moves whole chunks across PCIe (one way 0.97-0.99 of a memcpy "
         "instead of 0.92 at Llama pages of 16). Costly for the engines: the driver runs the "
         "fills inside the GPU like kernels of the daemon's, so without CUDA MPS the engines "
         "lose about a fifth of their GPU time while such copies run (+19-23% per step, +4-10% "
         "under MPS; straight pitched DMA +1-4%). Only once the other direction has been idle "
         "for 50 ms. Needs gpu_stage_slots > 0 and a chunk that fits gpu_stage_slot_bytes; "
         "0 = never (the default).", minimum=0),
    Knob("gpu_poll_interval_us", "float", 0.0, "How the daemon notices copies that landed: 0 "
         "re-checks every event-loop pass (lowest latency, one busy core while copies run); "
         "> 0 sleeps that many microseconds between checks that found nothing.", minimum=0.0),
)
