"""``kvd bench --restart`` as docs/performance.md runs it, at its smallest size: after a
SIGKILL the restarted daemon gets back every chunk the first one stored (the kill waits for
the records and their checksums: warm_record_delay_s is the knob's trade, not the restart's),
after a SIGTERM every chunk at once, after a cold start none; nothing left in /dev/shm."""

from __future__ import annotations

import re
import subprocess
import sys



def test_restart_bench_rows_say_what_the_docs_say():
    out = subprocess.run([sys.executable, "-m", "kvd", "bench", "--restart", "--restart-gib", "0.0625",
                          "--chunks", "2"], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert re.search(r"warm, SIGKILL: kill [\d.]+ s after the last store, every chunk recorded and "
                     r"checksummed", out.stdout), out.stdout
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^(cold|warm, SIGTERM|warm, SIGKILL) +[\d.]+ +(never|[\d.]+) +(\d+)% +(\d+)% +[\d.]+ +(\w+)$",
        out.stdout, re.M)}
    assert rows["cold"] == ("never", "0", "0", "new"), out.stdout
    assert rows["warm, SIGTERM"][1:] == ("100", "100", "clean"), out.stdout
    assert rows["warm, SIGKILL"][2:] == ("100", "crash"), out.stdout
