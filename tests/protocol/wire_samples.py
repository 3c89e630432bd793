"""Valid wire samples for the tests of kvd_protocol.wire (test_wire.py, test_wire_payloads.py).

The namespace, layout, buffer and flags maps of a ``register``, a keys frame
of 2 keys, a page-ids frame, and ``SAMPLES``: every op with a full set of
valid fields (required and optional) and its data frames.
"""

from __future__ import annotations

from kvd_protocol import wire as P

NS_WIRE = {"model": "org/m", "kv_dtype": "float16", "attention": "mha", "num_layers": 2,
           "kv_heads": 2, "head_dim": 4, "tp_size": 1, "first_layer": 0, "fingerprint": ""}
LAYOUT_WIRE = {"num_layers": 2, "planes": 2, "num_pages": 4, "page_size": 4, "row_bytes": 16,
               "page_stride": 64, "token_stride": 16, "bases": [[0, 0], [0, 256], [0, 512], [0, 768]]}
SHM_BUF = {"kind": "shm", "path": "/dev/shm/kvd-pool-1-abc", "size": 1024}
CUDA_BUF = {"kind": "cuda_ipc", "handle": bytes(range(64)), "offset": 0, "size": 1024,
            "device_uuid": "GPU-00000000-0000-0000-0000-000000000000"}
FLAGS = {"path": "/dev/shm/kvd-flags-1-abc", "size": 4096, "slots": 8}
KEYS2 = bytes(range(32))
PAGES = P.pages_frame([0, 1, 2, 3])

# every op with a full set of valid fields (required and optional) and frames
SAMPLES = {
    "hello": ({"client": "test", "pid": 123, "versions": [2]}, []),
    "register": ({"namespace": NS_WIRE, "tp_rank": 0, "buffers": [SHM_BUF, CUDA_BUF],
                  "layout": LAYOUT_WIRE, "flags": FLAGS}, []),
    "attach": ({"namespace": NS_WIRE, "tp_rank": 0}, []),
    "unregister": ({"reg": 5}, []),
    "lookup": ({"reg": 5, "lease_ms": 100, "part_tokens": [4]}, [KEYS2]),
    "store": ({"reg": 5, "after": 1, "deadline_us": 10**12, "tenant": "acme", "part_tokens": 4},
              [KEYS2, PAGES]),
    "load": ({"reg": 5, "slot": 3, "seq": 2**32 - 1, "after": 7, "lease": 9, "layerwise": True,
              "deadline_us": 10**12, "tail_pages": 1, "part_tokens": 4}, [KEYS2, PAGES]),
    "release": ({"lease": 9}, []),
    "heartbeat": ({}, []),
    "bye": ({}, []),
}
