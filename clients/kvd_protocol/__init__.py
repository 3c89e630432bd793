"""kvd_protocol: what the daemon and every client agree on, and nothing else.

Owns the wire format (``wire``), chunk keys (``keys``), the layout descriptor (``layout``),
the error tree (``errors``: transport vs server errors, wire codes), the runtime directory
(``runtime``), the flag page (``flags``), fd lending (``fd_pass``) and CUDA driver calls
(``cuda_driver``, ``cuda_vmm``). docs/protocol.md is the prose version, with test vectors.
Imports the standard library, msgpack, numpy, xxhash; never ``kvd`` or ``kvd_client``:
engines install the client and this package alone.
"""
