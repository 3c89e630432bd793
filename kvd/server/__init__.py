"""The daemon process: sockets, sessions, the service ops, control and stats.

Owns the event loop (``daemon``), the runtime directory (``runtime_dir``), the host tier
at start-up and exit (``host_tier``), client sessions with registrations and leases
(``sessions``), one method per engine op (``service``, copies via ``transfers``), operator
ops (``control``) and counters (``stats``). All state lives on the one event loop: no locks.
Imports kvd.tiers, kvd.copy, kvd.cuda (lazily: only with a GPU), kvd.config and
kvd_protocol; nothing below imports kvd.server. The request flow: docs/architecture.md.
"""
