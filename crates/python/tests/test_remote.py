"""metrale_ple.Engine and Server with table="remote": rows from
redis-server processes on free loopback ports, loaded by the
`metrale-ple table push` binary (METRALE_PLE_BIN, or `metrale-ple` on
PATH); skipped without redis-server or the binary. Every output row must
equal the resident table's."""

import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

import metrale_ple
from conftest import highway_rows


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture()
def servers():
    if shutil.which("redis-server") is None:
        pytest.skip("skipped: redis-server not installed")
    procs, urls = [], []
    for _ in range(3):
        port = free_port()
        p = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        deadline = time.time() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            assert time.time() < deadline, "redis-server did not start"
            time.sleep(0.02)
        urls.append(f"redis://127.0.0.1:{port}/0")
    yield ",".join(urls)
    for p in procs:
        p.kill()
        p.wait()


def push(ck_dir, urls):
    exe = os.environ.get("METRALE_PLE_BIN") or shutil.which("metrale-ple")
    if exe is None:
        pytest.skip("skipped: the metrale-ple binary (METRALE_PLE_BIN) is needed to push tables")
    subprocess.run([exe, "table", "push", str(ck_dir), "--to", urls], check=True,
                   stdout=subprocess.DEVNULL)


def outputs(ck, tokens, **kw):
    with metrale_ple.Engine(ck, prefix_cache_mib=0, resident_carries=0, **kw) as e:
        sid, _ = e.add_sequence(tokens)
        hw = highway_rows(tokens, e.width)
        e.prefill(sid, tokens, hw)
        return hw


def test_remote_rows_match_resident(tiny, servers):
    push(tiny.path, servers)
    tokens = np.random.default_rng(2).integers(0, 4000, 200).tolist()
    want = outputs(tiny, tokens, table="resident")
    got = outputs(tiny, tokens, table="remote", remote=servers, slots=4096)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_remote_needs_its_servers(tiny):
    with pytest.raises(ValueError, match="remote="):
        metrale_ple.Engine(tiny, table="remote")
    with pytest.raises(ValueError, match="table='remote'"):
        metrale_ple.Engine(tiny, table="cached", remote="redis://127.0.0.1:1/0")
