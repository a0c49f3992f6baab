"""Tensor-parallel start-up and exposure: a rank that dies while starting fails the engine within
seconds, naming it; a single-node TP engine listens on loopback only; a dead consensus checker
fails the soak instead of letting it report zero divergences."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

SMALL = dict(dtype="float32", speculative_algorithm="NONE", max_total_tokens=4096)


def test_engine_at_script_top_level_fails_fast_naming_the_rank_and_the_guard(tmp_path):
    """No `if __name__ == "__main__":` guard: the spawned rank dies re-importing the script. Before
    the fix rank 0 waited 300 s in the rendezvous, then said `DistStoreError: wait timeout`."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        from specserve import Engine

        engine = Engine(tp_size=2, **{SMALL!r})
        print("ENGINE BUILT")
        engine.shutdown()
    """))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ENGINE BUILT" not in out
    assert "RankStartupError: tensor-parallel rank 1" in out, out[-3000:]
    assert "exited with code 1 during spawn start-up" in out, out[-3000:]
    assert 'if __name__ == "__main__":' in out, out[-3000:]
    assert seconds < 60, seconds


def _listening(pid: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) of the sockets `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "0A":  # 0A: LISTEN
                found.append(fields[1])
    return found


def _is_loopback(local: str) -> bool:
    host = local.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return host.endswith("7F")
    return host == "00000000000000000000000001000000"  # ::1


def test_single_node_tp_engine_listens_on_loopback_only():
    from specserve import Engine

    with Engine(tp_size=2, **SMALL) as engine:
        pids = [os.getpid()] + [rp.proc.pid for rp in engine._workers]
        sockets = {pid: _listening(pid) for pid in pids}
        out = engine.generate("Hello", sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert len(out["output_ids"]) == 2
    assert all(sockets.values()), sockets  # the store and gloo listen somewhere: it must be loopback
    assert all(_is_loopback(s) for found in sockets.values() for s in found), sockets


def test_a_dead_consensus_checker_fails_the_soak_loudly():
    from test_tensor_parallel import soak

    code, out, seconds = soak("--max-tokens", "2000", "--speculative-algorithm", "NONE", "--json",
                              env={"SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER": "1",
                                   "SPECSERVE_FAULT_KILL_CONSENSUS_CHECKER": "1:40"}, timeout=180)
    assert code != 0, out[-3000:]
    assert "CRITICAL" in out and "rank consensus checker died on rank 1: RuntimeError: fault injection" in out, \
        out[-3000:]
    assert '"rank_divergences"' not in out, out[-3000:]
    assert seconds < 150
