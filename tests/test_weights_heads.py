"""The head records of the ``kvtiers`` load format (kvtiers.integrations.vllm.weights_heads),
driven directly, without a vLLM engine, on real tiers: two processes appending at once lose
no record (fs, and obj on a real SeaweedFS server), a fork takes the newest whole record, and a
damaged record (Infinity sizes, 2,000 nested arrays, bytes that are not JSON) is skipped as
damaged: never a crash, never a block on later publishes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="kvtiers.integrations.vllm needs vllm installed")

from kvtiers.engine.weights import WeightsIdentity  # noqa: E402
from kvtiers.integrations.vllm.weights_heads import Heads, _new_token  # noqa: E402

pytest_plugins = ["s3_fixture"]

NAME, REV = "twins [vllm-0.32/Net]", "r1"
PER_PROCESS = 25


def fs_config(root):
    return {"tiers": [{"type": "fs", "root_dir": str(root)}]}


def obj_config(options):
    return {"tiers": [{"type": "obj", **options}]}


def heads(cfg):
    return Heads(cfg, name=NAME, revision=REV, rank=0, world_size=1, timeout=60)


def ident(n: int, chunk_bytes: int = 4 << 20) -> WeightsIdentity:
    return WeightsIdentity(NAME, REV, 0, 1, chunk_bytes, f"{n:032x}")


CHILD = textwrap.dedent("""
    import json, os, sys, time
    from kvtiers.engine.weights import WeightsIdentity
    from kvtiers.integrations.vllm.weights_heads import Heads

    cfg, who, go, ready, n = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    out = []
    with Heads(cfg, name=%(name)r, revision=%(rev)r, rank=0, world_size=1, timeout=60) as h:
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.001)
        for i in range(n):
            digest = f"{who * 1000 + i + 1:032x}"
            got = h.append(WeightsIdentity(%(name)r, %(rev)r, 0, 1, 4 << 20, digest), 100 + i, f"p{who}")
            out.append([got, digest])
    print(json.dumps(out))
""") % {"name": NAME, "rev": REV}


def append_at_once(cfg, tmp_path, n):
    """Two processes, each appending ``n`` records, released together; what each append
    returned, with the digest it recorded."""
    go, script = tmp_path / "go", tmp_path / "child.py"
    script.write_text(CHILD)
    procs, ready = [], []
    for who in (1, 2):
        ready.append(tmp_path / f"ready{who}")
        procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(cfg), str(who), str(go),
                                       str(ready[-1]), str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.monotonic() + 240
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.05)
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results += json.loads(out.strip().splitlines()[-1])
    return results


def check_none_lost(cfg, results, n):
    recorded = {tok: digest for tok, digest in results if tok}
    # every append reported a record: each wrote other bytes than the newest before it
    assert len(recorded) == 2 * n, results
    with heads(cfg) as h:
        found = h.records()
        assert set(found) == set(recorded)  # none lost: two writers never stored one key
        assert h._count() == 2 * n
        for tok in found:
            assert h.read(tok).identity.digest == recorded[tok]
        newest = max(recorded)
        assert found[0] == newest
        assert h.latest().identity.digest == recorded[newest]  # the fork takes exactly the newest


def test_two_processes_appending_at_once_lose_no_record_on_fs(tmp_path):
    cfg = fs_config(tmp_path / "fs")
    check_none_lost(cfg, append_at_once(cfg, tmp_path, PER_PROCESS), PER_PROCESS)


def test_two_processes_appending_at_once_lose_no_record_on_obj(tmp_path, obj_options):
    """Fewer appends: each costs a walk of 20 lookups of SeaweedFS (HEAD requests)."""
    cfg = obj_config(obj_options)
    check_none_lost(cfg, append_at_once(cfg, tmp_path, 10), 10)


def test_the_newest_record_wins_and_the_same_bytes_again_add_nothing(tmp_path):
    with heads(fs_config(tmp_path)) as h:
        with pytest.raises(LookupError, match=r"no tier holds a publish of model 'twins .*' revision 'r1' rank 0/1"):
            h.latest()
        first = h.append(ident(1), 10, "a")
        assert h.append(ident(1), 10, "a") is None  # the newest already names these bytes
        second = h.append(ident(2), 20, "b")
        assert second > first and h.records() == [second, first]
        head = h.latest()
        assert (head.identity, head.nbytes, head.layout) == (ident(2), 20, "b")
        third = h.append(ident(1), 10, "a")  # back to the first bytes: a new newest record
        assert third > second and h.latest().identity == ident(1)


def test_a_token_never_sorts_below_the_newest_record_seen():
    ahead = f"{time.time_ns() // 1_000_000 + 3_600_000:012x}" + "0" * 8  # a publisher's clock an hour ahead
    assert _new_token(ahead) > ahead
    assert _new_token(None) < ahead


DAMAGED = {
    "chunk_bytes Infinity": b'{"chunk_bytes": Infinity, "digest": "%s", "layout": "x", "nbytes": 1}',
    "nbytes Infinity": b'{"chunk_bytes": 4194304, "digest": "%s", "layout": "x", "nbytes": Infinity}',
    "nbytes -Infinity": b'{"chunk_bytes": 4194304, "digest": "%s", "layout": "x", "nbytes": -Infinity}',
    "chunk_bytes NaN": b'{"chunk_bytes": NaN, "digest": "%s", "layout": "x", "nbytes": 1}',
    "chunk_bytes float": b'{"chunk_bytes": 4194304.0, "digest": "%s", "layout": "x", "nbytes": 1}',
    "chunk_bytes 1e400": b'{"chunk_bytes": 1e400, "digest": "%s", "layout": "x", "nbytes": 1}',
    "chunk_bytes 3000 digits": b'{"chunk_bytes": ' + b"9" * 3000 + b', "digest": "%s", "layout": "x", "nbytes": 1}',
    "chunk_bytes 1 TiB": b'{"chunk_bytes": 1099511627776, "digest": "%s", "layout": "x", "nbytes": 1}',
    "chunk_bytes odd": b'{"chunk_bytes": 4097, "digest": "%s", "layout": "x", "nbytes": 1}',
    "chunk_bytes true": b'{"chunk_bytes": true, "digest": "%s", "layout": "x", "nbytes": 1}',
    "digest number": b'{"chunk_bytes": 4096, "digest": 7, "layout": "x", "nbytes": 1}',
    "layout list": b'{"chunk_bytes": 4096, "digest": "%s", "layout": ["x"], "nbytes": 1}',
    "no digest": b'{"chunk_bytes": 4096, "layout": "x", "nbytes": 1}',
    "nested 2000": b"[" * 2000 + b"]" * 2000,
    "nested 2000 in a field": b'{"chunk_bytes": 4096, "digest": "%s", "layout": ' + b"[" * 1900 + b"]" * 1900 + b"}",
    "not JSON": b"\xff\xfe{{{",
    "a list": b"[1, 2]",
}


@pytest.mark.parametrize("how", list(DAMAGED))
def test_a_damaged_newest_record_is_skipped_and_never_blocks_a_publish(tmp_path, how, caplog):
    raw = DAMAGED[how].replace(b"%s", f"{9:032x}".encode())
    with heads(fs_config(tmp_path)) as h:
        good = h.append(ident(1), 10, "a")
        bad = _new_token(good)
        h._put(bad, raw)  # a record a buggy or hostile publisher stored: the tier's checksum passes
        assert h.records() == [bad, good]
        with pytest.raises(LookupError, match=f"head record {bad} of model .* is damaged"):
            h.read(bad)
        with caplog.at_level("WARNING", logger="kvtiers.weights.heads"):
            assert h.latest().identity == ident(1)  # the newest whole record
        assert f"head record {bad}" in caplog.text and "damaged" in caplog.text
        # a later publish of the same identity appends, and becomes the newest
        third = h.append(ident(2), 20, "b")
        assert third and third > bad and h.latest().identity == ident(2)


def test_only_damaged_records_are_a_lookup_error_naming_them(tmp_path):
    with heads(fs_config(tmp_path)) as h:
        tok = _new_token(None)
        h._put(tok, DAMAGED["chunk_bytes Infinity"].replace(b"%s", b"1" * 32))
        with pytest.raises(LookupError, match=r"no tier holds a whole head record of model .*1 damaged; newest: "
                                              r"the head record .* is damaged: TypeError chunk_bytes is inf"):
            h.latest()
        # a publish after it is found by the next fork
        assert h.append(ident(3), 30, "c")
        assert h.latest().identity == ident(3)


def test_a_record_the_tier_finds_corrupt_is_passed_over(tmp_path):
    """A disk fault in the newest record's file: the tier's checksum fails the load, the walk
    takes the record before it."""
    from kvtiers_fs.tier import FsTier

    with heads(fs_config(tmp_path)) as h:
        good = h.append(ident(4), 40, "d")
        bad = h.append(ident(5), 50, "e")
        FsTier.conformance_corrupt({"root_dir": str(tmp_path)}, h._w.identity.namespace(), b"h/" + bad.encode())
        assert h.records()[0] == bad
        with pytest.raises(LookupError, match=f"head record {bad} of model .* is in no tier whole"):
            h.read(bad)
        assert h.latest().identity == ident(4)
        assert h.records() == [good]  # the tier removed the corrupt file
