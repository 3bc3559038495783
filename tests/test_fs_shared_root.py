"""Several processes on one fs root: ``max_bytes`` bounds the namespace as a whole within
its documented slack, and a live writer in another PID namespace keeps its temporary file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
from kvtiers_fs import gc, layout
from test_fs_helpers import SLOT, Env, chunk_bytes, chunk_files, resolve, two_envs, wait_for

from kvtiers import Lookup

HELPERS = os.path.dirname(__file__)

# -- item 5: the bound covers every instance's files -------------------------------------------
SHARED_WRITER = textwrap.dedent(
    """
    import inspect, os, sys, threading, time
    sys.path.insert(0, {helpers!r})
    from kvtiers_fs import FsTier
    from test_fs_helpers import Env, wait_job
    from kvtiers import Job
    root, name, log, stop, per_job = {root!r}, {name!r}, {log!r}, {stop!r}, {per_job!r}
    e = Env(root, slots=max(2, per_job), slot_bytes={slot})
    opts = dict(max_bytes={max_bytes}, n_write_threads={threads})
    if "rescan_seconds" in inspect.signature(FsTier).parameters:  # (so the test runs on older code too)
        opts["rescan_seconds"] = {rescan}
    t = e.open(**opts)
    assert t.scanned.wait(30)
    out = open(log, "w", buffering=1)
    done = threading.Event()

    most = [0]  # the most bytes of stores in flight seen at once while not the cleaner

    def monitor():  # when each rescan (and its eviction) completed, as seen from here
        last = None
        while not done.is_set():
            ls = getattr(t, "last_scan", None)
            if ls is not None and ls != last:
                out.write(f"scan {{ls[0]!r}} {{time.time()!r}}\\n")
                last = ls
            share = getattr(t, "_share", None)
            if share is not None and not getattr(t, "is_cleaner", True):
                most[0] = max(most[0], share._inflight)
            time.sleep(0.0005)

    threading.Thread(target=monitor, daemon=True).start()
    for i in range({n} // per_job):  # jobs of per_job keys
        keys = [b"%s-%d" % (name.encode(), i * per_job + j) for j in range(per_job)]
        e.fill(keys, list(range(per_job)))
        s0 = time.time()
        t.submit_store(Job(i, tuple(keys), tuple(range(per_job))))
        r = wait_job(t, i)
        for k in keys:
            out.write(f"store {{s0!r}} {{time.time()!r}} {{int(k not in r.failed_keys)}}\\n")
        time.sleep({pace})
    out.write(f"inflight {{most[0]}}\\n")
    out.write("done\\n")
    parent, give_up = os.getppid(), time.monotonic() + 300
    # keep rescanning until the test has seen the end state (or the test is gone)
    while not os.path.exists(stop) and os.getppid() == parent and time.monotonic() < give_up:
        time.sleep(0.01)
    done.set()
    t.close()
    """
)


def _stop_writers(stop: str, procs: list[subprocess.Popen]) -> None:
    """Tell the writer processes to stop (the ``stop`` file), wait for each, kill one that hangs."""
    open(stop, "w").close()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _read_log(path: str):
    scans, stores, done = [], [], False
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return scans, stores, done
    for line in lines:
        f = line.split()
        if f[:1] == ["scan"] and len(f) == 3:
            scans.append((float(f[1]), float(f[2])))
        elif f[:1] == ["store"] and len(f) == 4:
            stores.append((float(f[1]), float(f[2]), f[3] == "1"))
        elif f == ["done"]:
            done = True
    return scans, stores, done


def _inflight(path: str) -> int:
    """The most bytes of stores in flight a writer saw at once while it was not the cleaner."""
    return max([int(line.split()[1]) for line in open(path).read().splitlines() if line.startswith("inflight ")],
               default=0)


def _sample_until_done(procs: list[subprocess.Popen], logs: list[str], sample: Callable[[], None],
                       every: float) -> None:
    """Call ``sample()`` every ``every`` s until each writer's log says it is done (120 s at
    most); a writer that exits before that fails the test with its stderr."""
    deadline = time.monotonic() + 120
    while not all(_read_log(p)[2] for p in logs):
        assert time.monotonic() < deadline, "the writers did not finish"
        assert all(p.poll() is None for p in procs), [p.stderr.read().decode() for p in procs if p.poll()]
        sample()
        time.sleep(every)


def test_three_processes_storing_ten_times_the_bound_stay_within_the_slack(tmp_path):
    root = str(tmp_path / "root")
    slot, rescan, n_files = 4096, 0.1, 32
    file_bytes = layout.file_bytes(slot)
    bound = n_files * file_bytes
    stop = str(tmp_path / "stop")
    logs = [str(tmp_path / f"w{i}.log") for i in range(3)]
    procs = [
        subprocess.Popen([sys.executable, "-c", SHARED_WRITER.format(
            helpers=HELPERS, root=root, name=f"w{i}", log=logs[i], stop=stop, slot=slot,
            max_bytes=bound, rescan=rescan, n=10 * n_files, pace=0.005, per_job=1, threads=2)],
            stderr=subprocess.PIPE)
        for i in range(3)
    ]
    samples = []
    try:
        def sample() -> None:
            ts = time.time()
            total = chunk_bytes(root)
            samples.append((ts, time.time(), total))

        _sample_until_done(procs, logs, sample, 0.01)
        # stores have stopped: within one rescan (plus a scan) the namespace is within the bound
        t_end = time.monotonic() + rescan + 5
        while chunk_bytes(root) > bound and time.monotonic() < t_end:
            time.sleep(0.02)
        final = chunk_bytes(root)
        assert final <= bound, f"{final} bytes in the namespace {rescan + 5:.1f} s after the last store; bound {bound}"
        assert final >= bound // 2, f"only {final} of {bound} bytes left: chunks were deleted in bursts"
    finally:
        _stop_writers(stop, procs)
    assert [p.returncode for p in procs] == [0, 0, 0], [p.stderr.read().decode() for p in procs]
    logs_read = [_read_log(p) for p in logs]
    assert all(len(st) == 10 * n_files and all(ok for _, _, ok in st) for _, st, _ in logs_read)
    # the documented slack, at every sample: for any instance i whose rescan that started at s_i
    # had completed, at most max_bytes + the chunks the others published since s_i + the chunks
    # i itself stored while the sample was taken
    worst = 0
    for ts, te, total in samples:
        allowed = float("inf")
        for i, (scans, stores, _) in enumerate(logs_read):
            starts = [s for s, seen in scans if seen <= ts]
            if not starts:
                continue
            s_i = max(starts)
            others = sum(1 for j, (_, st, _) in enumerate(logs_read) if j != i for s0, s1, _ in st
                         if s1 >= s_i and s0 <= te)
            own = sum(1 for s0, s1, _ in stores if s1 >= ts and s0 <= te)
            allowed = min(allowed, bound + (others + own + 3) * file_bytes)
        assert total <= allowed, f"{total} bytes at {ts:.3f}, documented slack allows {allowed}"
        worst = max(worst, total)
    print(f"shared root: bound {bound} B, worst sample {worst} B, final {final} B, {len(samples)} samples")
    # the test means something only if the writers raced: stores of two writers overlapped in
    # time, and the samples saw the namespace at the bound, give or take a chunk per writer
    # (each may have just evicted one: a CI run's fullest of 205 samples held 31 of 32 files;
    # a sample past the bound is luck of timing on a loaded machine, so it is not required)
    last_end: dict[int, float] = {}
    raced = False
    for s0, s1, i in sorted((s0, s1, i) for i, (_, st, _) in enumerate(logs_read) for s0, s1, _ in st):
        raced |= any(end > s0 for j, end in last_end.items() if j != i)
        last_end[i] = max(last_end.get(i, s1), s1)
    assert len(samples) > 20 and raced and worst >= bound - 3 * file_bytes, (len(samples), raced, worst, bound)


# -- item 6: a writer in another PID namespace is alive while it holds its lock ----------------
NS_WRITER = textwrap.dedent(
    """
    import os, sys, time
    root, go, dead = {root!r}, {go!r}, {dead}

    def writer():
        sys.path.insert(0, {helpers!r})
        from test_fs_helpers import Env, wait_job
        from kvtiers import Job
        real = os.pwritev

        def held_pwritev(fd, bufs, off):  # the store waits, temporary file created, for the test
            while len(bufs) == 2 and not os.path.exists(go):  # [chunk, trailer]: not the O_DIRECT probe
                time.sleep(0.01)
            return real(fd, bufs, off)

        os.pwritev = held_pwritev
        e = Env(root, slots=1)
        t = e.open()
        e.fill([b"ns-writer"], [0])
        t.submit_store(Job(1, (b"ns-writer",), (0,)))
        r = wait_job(t, 1, timeout=120)
        t.close()
        print("RESULT", r.ok, r.error, flush=True)
        os._exit(0 if r.ok else 1)

    # run the writer as pid `dead` of this namespace: a pid no process has in the test's namespace
    while True:
        pid = os.fork()
        if pid == 0:
            if os.getpid() == dead:
                writer()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if pid == dead:
            sys.exit(os.waitstatus_to_exitcode(status))
        if pid > dead:
            print("overshot pid", pid, file=sys.stderr)
            sys.exit(3)
    """
)


def test_a_writer_in_another_pid_namespace_keeps_its_temp_file(tmp_path):
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.strip()}")
    dead = next(p for p in range(50, 400) if not os.path.exists(f"/proc/{p}"))
    root = str(tmp_path / "root")
    go = str(tmp_path / "go")
    script = NS_WRITER.format(root=root, go=go, dead=dead, helpers=HELPERS)
    proc = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    e = Env(root)
    try:
        def temps():
            return [p for p in chunk_files(root, ".tmp") if os.path.basename(p).startswith(b"ns-writer".hex())]

        wait_for(lambda: temps() or proc.poll() is not None, timeout=60, what="the writer's temporary file")
        (tmp,) = temps()
        assert f".{dead}@{layout._HOST}." in os.path.basename(tmp)  # its pid is dead in our namespace
        t = e.open()  # the open-time scan of another instance on this host
        assert t.scanned.wait(30)
        assert os.path.exists(tmp) and t.stale_removed == []
        report = gc.gc_root(root)  # and `kvtiers fs gc`
        assert os.path.exists(tmp) and report.removed == []
        open(go, "w").close()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        assert "RESULT True" in out
        assert e.load(t, [b"ns-writer"]).ok
        e.check([b"ns-writer"])
    finally:
        open(go, "w").close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        e.close()


def test_a_rescan_learns_the_others_files_and_removals(tmp_path):
    file_bytes = layout.file_bytes(SLOT)
    with two_envs(tmp_path) as (a, b):
        tb = b.open()
        ta = a.open(max_bytes=8 * file_bytes, rescan_seconds=0.05)
        assert ta.scanned.wait(30)
        theirs, mine = [b"b%d" % i for i in range(6)], [b"a%d" % i for i in range(4)]
        for k in theirs:
            assert b.store(tb, [k]).ok
        # the order a knows b's chunks by: their files' mtimes (b's first stores are the oldest,
        # unless the wall clock stepped back between two of them)
        mtimes = {k: os.stat(tb.path(k)).st_mtime for k in theirs}
        oldest = sorted(theirs, key=lambda k: (mtimes[k], theirs.index(k)))[:2]
        for k in mine:
            assert a.store(ta, [k]).ok
        # a's next rescan sees 10 chunks under a bound of 8: the two oldest (b's first) go
        # (the files go first, then their keys are reported through ctx.removed)
        wait_for(lambda: len(chunk_files(str(tmp_path))) == 8 and len([k for k, why in a.removed if why == "evicted"])
                 >= 2, timeout=10, what="the rescan to evict and report")
        evicted = sorted(k for k, why in a.removed if why == "evicted")
        # (failed once in CI, 7 December: b0 and b2 went, not b1; the clocks say why next time)
        assert evicted == sorted(oldest), (evicted, mtimes, {k: ta.index.clock_of(k) for k in theirs + mine})
        kept = [k for k in theirs if k not in oldest]
        assert all(os.path.exists(ta.path(k)) for k in kept + mine)
        os.unlink(ta.path(kept[0]))  # removed under a, e.g. by gc: its directory's mtime changes
        wait_for(lambda: kept[0] not in ta.index and ta.index.used == 7 * file_bytes, timeout=10,
                 what="the rescan to notice")
        assert resolve(ta, [kept[0]]) == [Lookup.MISS]


def test_merge_scan_orders_by_mtime_or_own_use_and_keeps_what_changed_meanwhile():
    from kvtiers_fs.index import Index
    from kvtiers_fs.keytable import dir_of, fingerprint, fingerprints

    idx = Index(negative_ttl=1.0, file_bytes=10)
    now = time.time()
    idx.add(b"used-here")  # this instance's use is newer than the file's mtime
    idx.add(b"gone")
    started = time.time()
    idx.add(b"stored-meanwhile")
    listed = [b"used-here", b"old", b"newer"]
    fps = fingerprints(listed)
    dirs = {dir_of(int(f)) for f in fingerprints(listed + [b"gone", b"stored-meanwhile"])}
    gone = idx.merge_listing(dirs, fps, [now - 300, now - 200, now - 100], started)
    order = [b"old", b"newer", b"used-here", b"stored-meanwhile"]
    assert [fp for fp, _ in idx.victims(4)] == [fingerprint(k) for k in order]
    assert gone == 1 and b"gone" not in idx and idx.used == 40


def test_probes_and_loads_of_the_others_chunks_never_make_an_instance_evict_them(tmp_path):
    """B knows nothing of A's old chunks; it finds A's fresh ones by lookups and loads. Its
    own stores must not evict those fresh chunks (they are not the oldest in the namespace:
    A's old ones are); its next rescan evicts the oldest, A's old chunks, first."""
    file_bytes = layout.file_bytes(SLOT)
    with two_envs(tmp_path) as (a, b):
        ta = a.open()
        tb = b.open(max_bytes=13 * file_bytes, rescan_seconds=3600.0)
        assert tb.scanned.wait(30)  # B's view: empty
        old, fresh = [b"old-%d" % i for i in range(10)], [b"fresh-%d" % i for i in range(10)]
        assert a.store(ta, old).ok and a.store(ta, fresh).ok
        long_ago = time.time() - 1000
        for k in old:
            os.utime(ta.path(k), (long_ago, long_ago))
        assert resolve(tb, fresh) == [Lookup.HIT] * 10  # probes find them
        assert b.load(tb, fresh).ok  # and B reads them
        mine = [b"b-%d" % i for i in range(4)]
        for k in mine:
            assert b.store(tb, [k]).ok
        assert all(os.path.exists(tb.path(k)) for k in fresh + mine), "B evicted chunks it had just read"
        assert [k for k, why in b.removed if why == "evicted"] == []
        # B's rescan learns the whole namespace (24 chunks, bound 13): the 11 oldest go, A's old first
        tb._scan_once(clean=False, full=False)  # the directories that changed: all of them
        left = sorted(os.path.basename(p) for p in chunk_files(str(tmp_path)))
        evicted = [k for k, why in b.removed if why == "evicted"]
        assert len(evicted) == 11 and set(evicted[:10]) == set(old)  # oldest first
        assert len(left) == 13 and set(left) >= {k.hex() + ".bin" for k in mine}
