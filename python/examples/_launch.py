"""How the examples start their own ranks when run as `python <example>.py`:
the script again, once per rank, on this machine, with the environment a
launcher gives (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and
a fresh job secret in FERROCOMM_TOKEN; rank 0 hosts the store on a free
port. Not part of ferrocomm: under torchrun, or any launcher that sets
these, an example needs none of it (set FERROCOMM_TOKEN yourself there)."""

import os
import secrets
import socket
import subprocess
import sys


def launch(script: str, world: int) -> int:
    """Run `script` as ranks 0..world-1 and wait for them (up to 120 s
    each): the highest exit status among them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               FERROCOMM_TOKEN=secrets.token_hex(16))
    procs = [subprocess.Popen([sys.executable, script], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    return max(p.wait(timeout=120) for p in procs)
