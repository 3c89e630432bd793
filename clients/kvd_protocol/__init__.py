"""kvd_protocol: what the daemon and every client agree on, and nothing else.

Owns the wire format (``wire``: message framing, op table, validation,
replies), the chunk key spec (``keys``: namespaces and prefix-chained
xxh3-128 keys), the engine layout descriptor (``layout``), the error
hierarchy (``errors``: transport vs server errors, wire codes), the
runtime-directory rules (``runtime``: where the sockets are) and the CUDA
driver calls both sides make through ctypes (``cuda_driver``).
docs/protocol.md is the prose version, with test vectors.

Imports: the standard library, msgpack, numpy, xxhash. It must never import
``kvd`` (the daemon) or ``kvd_client``: engines install the client and this
package alone.
"""
