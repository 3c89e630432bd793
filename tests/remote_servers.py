"""The real stores of the remote tier's tests: kvd/bench/stores.py (shared with ``kvd bench
--remote``)."""

from kvd.bench.stores import (  # noqa: F401 - re-exported for the tests
    MooncakeMaster,
    RedisServer,
    Server,
    free_port,
    mooncake_env,
    mooncake_master_path,
    wait_port,
)
