"""The parts of examples/fleet.py: a local checkpoint and tokenizer (model), the processes of one
arm (procs), the round-robin proxy (proxy), the load generator and the servers' counters (bench)."""
