"""The shared bound in bytes (issue 36 item 2): several bounded processes on one root, each
storing ten times the bound as fast as it can while the cleaner passes rarely, never hold
more than ``max_bytes`` plus the slack docs/fs.md gives (written out here from the doc, not
taken from the code under test): for each instance that is not the cleaner, its share (the
larger of F and max_bytes / 16 rounded down to a multiple of F, F the chunk file's size)
plus ``n_write_threads x F`` of stores in flight. One case stores jobs of several keys with
four write threads, so that several stores are in flight at once and that term is reached."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from kvtiers_fs import layout, lease
from kvtiers_fs.share import Share
from test_fs_helpers import chunk_bytes, chunk_files
from test_fs_shared_root import HELPERS, SHARED_WRITER, _inflight, _read_log, _sample_until_done, _stop_writers


def documented_share(max_bytes: int, file_bytes: int) -> int:
    """docs/fs.md, Sharing a bounded root: "the larger of F and max_bytes / 16 rounded down
    to a multiple of F"."""
    return max(file_bytes, (max_bytes // 16) // file_bytes * file_bytes)


# each writer also measures the root right after each of its jobs is stored (the instant a store
# lands, before any pass): one sample per job however loaded the machine, beside the test's own sampler
_STORED = "    r = wait_job(t, i)\n"
assert SHARED_WRITER.count(_STORED) == 1
WRITER = SHARED_WRITER.replace(_STORED, _STORED + """\
    out.write(f"after-store {{chunk_bytes(root)}}\\n")
""").replace("from test_fs_helpers import Env, wait_job", "from test_fs_helpers import Env, chunk_bytes, wait_job")


def _after_store(log: str) -> list[int]:
    """The root's bytes a writer measured right after each of its jobs was stored."""
    return [int(line.split()[1]) for line in open(log).read().splitlines() if line.startswith("after-store ")]


def _run_writers(tmp_path, n_writers: int, rescan: float, per_job: int, threads: int):
    root = str(tmp_path / "root")
    slot, n_files = 4096, 32
    file_bytes = layout.file_bytes(slot)
    bound = n_files * file_bytes
    stop = str(tmp_path / "stop")
    logs = [str(tmp_path / f"w{i}.log") for i in range(n_writers)]
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER.format(
            helpers=HELPERS, root=root, name=f"w{i}", log=logs[i], stop=stop, slot=slot,
            max_bytes=bound, rescan=rescan, n=10 * n_files, pace=0.0, per_job=per_job, threads=threads)],
            stderr=subprocess.PIPE)
        for i in range(n_writers)
    ]
    samples = []
    try:
        _sample_until_done(procs, logs, lambda: samples.append(chunk_bytes(root)), 0.005)
        t_end = time.monotonic() + rescan + 10  # stores have stopped: the cleaner's next pass
        while chunk_bytes(root) > bound and time.monotonic() < t_end:
            time.sleep(0.05)
        final = chunk_bytes(root)
    finally:
        _stop_writers(stop, procs)
    assert [p.returncode for p in procs] == [0] * n_writers, [p.stderr.read().decode() for p in procs]
    stores = [_read_log(p)[1] for p in logs]
    assert all(len(st) == 10 * n_files and all(ok for _, _, ok in st) for st in stores)  # stores keep succeeding
    assert chunk_files(root, ".tmp") == []
    after = [_after_store(p) for p in logs]
    assert [len(a) for a in after] == [10 * n_files // per_job] * n_writers  # a sample after every job
    return bound, file_bytes, final, samples + [b for a in after for b in a], max(_inflight(p) for p in logs)


@pytest.mark.parametrize(("n_writers", "per_job", "threads"), [(2, 1, 2), (4, 1, 2), (3, 8, 4)],
                         ids=["2-writers", "4-writers", "3-writers-8-keys-per-job"])
def test_writers_storing_ten_times_the_bound_stay_within_max_bytes_plus_the_slack(tmp_path, n_writers, per_job,
                                                                                  threads):
    rescan = 3.0  # the cleaner lists what the others stored every 3 s; they store 320 chunks each in less
    bound, file_bytes, final, samples, inflight = _run_writers(tmp_path, n_writers, rescan, per_job, threads)
    # docs/fs.md: max_bytes + for each other bounded instance (share + n_write_threads x F);
    # plus a chunk per writer for a sampler's walk, which is not one instant. The samples: the
    # test's own while the writers store, and each writer's right after each of its jobs
    documented = (n_writers - 1) * (documented_share(bound, file_bytes) + threads * file_bytes)
    slack = documented + n_writers * file_bytes
    worst = max(samples)
    print(f"{n_writers} writers x {per_job} keys per job, {threads} write threads: bound {bound} B, slack {slack} B, "
          f"worst sample {worst} B ({worst / bound:.2f}x), final {final} B, {len(samples)} samples, "
          f"most in flight {inflight} B")
    assert worst <= bound + slack, f"{worst} bytes on a bound of {bound} (slack {slack})"
    assert final <= bound, f"{final} bytes {rescan + 10:.0f} s after the last store; bound {bound}"
    if per_job > 1:  # several stores of one writer were in flight at once: the n_write_threads x F term
        assert file_bytes < inflight <= threads * file_bytes


def test_the_share_counts_what_the_cleaner_has_not_acknowledged(tmp_path):
    nsdir = str(tmp_path)
    share = Share(budget=3, read=lambda: lease.read_passes(nsdir))
    assert share.reserve(2) == 0
    share.published(b"a", 2)
    assert share.reserve(2) == 1 and share.reads == 1  # over: the record read again (there is none yet)
    share.published(b"b", 2)
    lease.write_passes(nsdir, 5, 4)  # pass 5 began; 4 completed
    assert share.reserve(1) == 2  # a and b were published before a read that saw 5: from pass 6 on
    share.unreserve(1)  # (that store failed)
    assert [k for k, _ in share.take(1)] == [b"a"] and share.net == 2  # its oldest, removed by the caller
    share.give_back(b"a", 2)  # (it could not be removed after all)
    lease.write_passes(nsdir, 6, 5)
    share.refresh()
    assert share.net == 4  # pass 6 began after that read but has not completed: still counted
    lease.write_passes(nsdir, 6, 6)
    share.refresh()
    assert share.net == 2  # b is counted by the cleaner now; a was given back after the read
    share.refresh()
    assert share.net == 2
    lease.write_passes(nsdir, 7, 7)
    share.refresh()
    assert share.net == 0
    with open(os.path.join(nsdir, lease.PASSES), "r+b") as f:  # a torn or foreign record reads as none
        f.write(b"garbage")
    assert lease.read_passes(nsdir) is None


def test_a_fifo_or_link_at_the_pass_record_never_blocks_the_cleaner(tmp_path):
    path = tmp_path / lease.PASSES
    os.mkfifo(path)  # anyone who can write the root
    t0 = time.monotonic()
    assert lease.write_passes(str(tmp_path), 1, 1) is False and lease.read_passes(str(tmp_path)) is None
    os.unlink(path)
    os.symlink("/dev/zero", path)
    assert lease.write_passes(str(tmp_path), 1, 1) is False and lease.read_passes(str(tmp_path)) is None
    assert time.monotonic() - t0 < 5
    os.unlink(path)
    assert lease.write_passes(str(tmp_path), 2, 1) and lease.read_passes(str(tmp_path)) == (2, 1)
