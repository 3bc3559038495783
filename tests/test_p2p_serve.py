"""An engine serving its host cache to peers (the ``serve`` block): a decode manager pulls
over p2p what a prefill manager stored, every byte checked; slots are pinned while sent."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("zmq")
torch = pytest.importorskip("torch")

from kvtiers import ConfigError  # noqa: E402
from kvtiers.engine.manager import TieringManager  # noqa: E402

LAYERS, BLOCKS, BPC = 2, 32, 2


def kv(seed: int | None):
    g = torch.Generator().manual_seed(seed or 0)

    def make():
        return torch.rand((BLOCKS, 16, 8), generator=g) if seed is not None else torch.zeros(BLOCKS, 16, 8)

    return {"kv": [[make() for _ in range(2)] for _ in range(LAYERS)]}


def key(i: int) -> bytes:
    return b"prefix-%d" % i


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_serve_block_lets_a_peer_pull_the_host_cache(backend):
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    src = kv(1)
    prefill = TieringManager.from_config({"host_bytes": 1 << 20, "blocks_per_chunk": BPC,
                                          "serve": {"bind": "tcp://127.0.0.1:0", "nixl": backend == "nixl"}}, src,
                                         namespace_fields={"model": "m"})
    port = int(prefill.serve.endpoint.rsplit(":", 1)[1])
    stop = threading.Event()

    def engine_loop():  # the prefill engine's steps: they answer the peers' requests
        while not stop.is_set():
            prefill.poll()
            time.sleep(0.001)

    dst = kv(None)
    decode = TieringManager.from_config({"host_bytes": 1 << 20, "blocks_per_chunk": BPC,
                                         "tiers": [{"type": "p2p", "host": "127.0.0.1", "port": port,
                                                    "backend": backend}]}, dst,
                                        namespace_fields={"model": "m"})
    try:
        keys = [key(i) for i in range(4)]
        (res,) = prefill.wait([prefill.store(keys, list(range(8)))])
        assert res.ok
        loop = threading.Thread(target=engine_loop)
        loop.start()
        deadline = time.monotonic() + 20
        while (found := decode.lookup(keys)).num_chunks < 4:
            assert time.monotonic() < deadline, found
            time.sleep(0.01)
        assert found.sources == ("p2p",) * 4
        (res,) = decode.wait([decode.load(keys, list(range(10, 18)))], timeout=30)
        assert res.ok, res
        for layer in range(LAYERS):
            for kvi in range(2):
                assert torch.equal(dst["kv"][layer][kvi][10:18], src["kv"][layer][kvi][0:8])
        assert prefill.serve.served == 4
        stop.set()
        loop.join()
        prefill.poll()
        assert prefill.cache.pinned_slots() == 0  # every pin taken for sending was released
    finally:
        stop.set()
        decode.close()
        prefill.close()


def test_serve_block_errors_are_config_errors():
    with pytest.raises(ConfigError, match="unknown option 'port'"):
        TieringManager.from_config({"host_bytes": 1 << 20, "serve": {"port": 1}}, kv(1))
    with pytest.raises(ConfigError, match="nixl must be true or false"):
        TieringManager.from_config({"host_bytes": 1 << 20, "serve": {"nixl": "yes"}}, kv(1))
    with pytest.raises(ConfigError, match="kvtiers p2p keygen"):
        TieringManager.from_config({"host_bytes": 1 << 20, "serve": {"bind": "tcp://0.0.0.0:0"}}, kv(1))
