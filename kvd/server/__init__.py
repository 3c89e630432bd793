"""The daemon process: sockets, sessions, the service ops, control and stats.

Owns the event loop (``daemon``: start-up, the two ROUTER sockets, the
reaper, shutdown), the runtime directory on the daemon's side
(``runtime_dir``), client sessions with their registrations and leases
(``sessions``), one method per engine op (``service``), operator ops
(``control``) and counters (``stats``). All state lives on the one event
loop: no locks.

Imports: kvd.tiers, kvd.copy, kvd.cuda (lazily: only with a GPU), kvd.config
and kvd_protocol. Nothing below imports kvd.server.
"""
