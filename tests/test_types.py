"""The contract's types: Job, JobResult, Arena, Namespace, TierContext validation."""

from __future__ import annotations

import ctypes
import hashlib
import json

import numpy as np
import pytest

from kvtiers import Arena, Job, JobResult, Lookup, Namespace, TierContext
from kvtiers.types import check_key, check_keys

# -- keys ------------------------------------------------------------------------


@pytest.mark.parametrize("key", [b"\x00", b"a" * 64, bytes(range(64)), b"/..", b"\xff"])
def test_valid_keys(key: bytes) -> None:
    assert check_key(key) is key


@pytest.mark.parametrize("key", [b"", b"a" * 65])
def test_key_length_out_of_range_is_value_error(key: bytes) -> None:
    with pytest.raises(ValueError, match=f"1-64 bytes long, got {len(key)} bytes"):
        check_key(key)


@pytest.mark.parametrize("key", ["abc", bytearray(b"abc"), 7, None])
def test_key_not_bytes_is_type_error(key: object) -> None:
    with pytest.raises(TypeError, match="key must be bytes"):
        check_key(key)


def test_check_keys_rejects_single_bytes_or_str() -> None:
    with pytest.raises(TypeError, match="sequence of bytes"):
        check_keys(b"abc")
    with pytest.raises(TypeError, match="sequence of bytes"):
        check_keys("abc")
    assert check_keys([b"a", b"b"]) == (b"a", b"b")


# -- Job -------------------------------------------------------------------------


def test_job_normalises_keys_and_slots_to_tuples() -> None:
    job = Job(3, [b"a", b"b"], [5, 7])
    assert job.keys == (b"a", b"b")
    assert job.slots == (5, 7)
    assert all(type(s) is int for s in job.slots)


def test_job_accepts_numpy_integer_slots_and_job_id() -> None:
    job = Job(np.int64(9), (b"a", b"b"), np.array([1, 2], dtype=np.int32))
    assert job.job_id == 9 and type(job.job_id) is int
    assert job.slots == (1, 2)
    assert all(type(s) is int for s in job.slots)


def test_empty_job_is_valid() -> None:
    job = Job(0, (), ())
    assert job.keys == () and job.slots == ()


def test_job_is_frozen() -> None:
    job = Job(1, (b"a",), (0,))
    with pytest.raises(AttributeError):
        job.keys = (b"b",)  # type: ignore[misc]


@pytest.mark.parametrize("key", [b"", b"x" * 65])
def test_job_rejects_key_length(key: bytes) -> None:
    with pytest.raises(ValueError, match="1-64 bytes"):
        Job(1, (b"ok", key), (0, 1))


def test_job_rejects_non_bytes_key() -> None:
    with pytest.raises(TypeError, match="key must be bytes"):
        Job(1, (b"ok", "str"), (0, 1))  # type: ignore[arg-type]


def test_job_rejects_duplicate_keys() -> None:
    with pytest.raises(ValueError, match=r"job 4: duplicate key b'k'"):
        Job(4, (b"k", b"j", b"k"), (0, 1, 2))


def test_job_rejects_duplicate_slots_including_numpy_equal_ints() -> None:
    with pytest.raises(ValueError, match="job 4: duplicate slot 3"):
        Job(4, (b"a", b"b"), (3, np.int32(3)))


def test_job_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="job 2: 2 keys but 1 slots"):
        Job(2, (b"a", b"b"), (0,))


@pytest.mark.parametrize("slot", [1.0, "1", None])
def test_job_rejects_non_integer_slot(slot: object) -> None:
    with pytest.raises(TypeError, match="slot must be an integer"):
        Job(1, (b"a",), (slot,))  # type: ignore[arg-type]


def test_job_rejects_non_integer_job_id() -> None:
    with pytest.raises(TypeError, match="job_id must be an integer"):
        Job("1", (), ())  # type: ignore[arg-type]


def test_job_rejects_keys_given_as_one_bytes() -> None:
    with pytest.raises(TypeError):
        Job(1, b"ab", (0, 1))  # type: ignore[arg-type]


# -- JobResult ---------------------------------------------------------------------


def test_jobresult_ok_follows_failed_keys() -> None:
    assert JobResult(1).ok
    assert JobResult(1, (), nbytes=4096).ok
    bad = JobResult(1, [b"a"], error="missing")
    assert not bad.ok
    assert bad.failed_keys == (b"a",)  # normalised to a tuple
    assert bad.error == "missing"


def test_jobresult_is_frozen_and_ok_is_a_property() -> None:
    r = JobResult(1)
    with pytest.raises(AttributeError):
        r.ok = False  # type: ignore[misc]
    with pytest.raises(AttributeError):
        r.failed_keys = (b"x",)  # type: ignore[misc]


def test_lookup_has_three_answers() -> None:
    assert {x.name for x in Lookup} == {"HIT", "MISS", "RETRY"}


# -- Arena -------------------------------------------------------------------------


@pytest.mark.parametrize("slot_bytes", [0, -4096, 100, 4095, 4097, 6144])
def test_arena_slot_bytes_must_be_multiple_of_4096(slot_bytes: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        Arena.allocate(2, slot_bytes)
    with pytest.raises(ValueError, match="multiple of 4096"):
        Arena(bytearray(4 * 8192), slot_bytes)


def test_arena_allocate_rejects_no_slots() -> None:
    with pytest.raises(ValueError, match="num_slots must be positive"):
        Arena.allocate(0, 4096)


def test_arena_allocate_is_page_aligned_and_sized() -> None:
    arena = Arena.allocate(3, 8192)
    assert len(arena) == 3
    assert arena.slot_bytes == 8192
    assert len(arena.buffer) == 3 * 8192
    base = ctypes.addressof(ctypes.c_char.from_buffer(arena.buffer))
    assert base % 4096 == 0
    for i in range(3):
        addr = ctypes.addressof(ctypes.c_char.from_buffer(arena[i]))
        assert addr == base + i * 8192
        assert addr % 4096 == 0


def test_arena_slots_are_writable_zero_copy_views() -> None:
    arena = Arena.allocate(4, 4096)
    view = arena[2]
    assert isinstance(view, memoryview)
    assert view.ndim == 1 and len(view) == 4096 and not view.readonly
    view[:] = b"\x5a" * 4096
    assert bytes(arena.buffer[2 * 4096 : 3 * 4096]) == b"\x5a" * 4096  # same memory
    assert bytes(arena[1]) == bytes(4096) and bytes(arena[3]) == bytes(4096)
    arena.buffer[4096] = 7
    assert arena[1][0] == 7


def test_arena_over_existing_buffer_shares_memory_and_drops_the_tail() -> None:
    backing = bytearray(2 * 4096 + 100)
    arena = Arena(backing, 4096)
    assert len(arena) == 2
    assert len(arena.buffer) == 2 * 4096
    arena[1][0] = 9
    assert backing[4096] == 9


def test_arena_rejects_readonly_and_too_small_buffers() -> None:
    with pytest.raises(ValueError, match="writable"):
        Arena(bytes(8192), 4096)
    with pytest.raises(ValueError, match="holds no slot"):
        Arena(bytearray(4095), 4096)


def test_arena_accepts_numpy_buffer_of_other_dtype() -> None:
    a = np.zeros((2, 4096 // 4), dtype=np.float32)
    arena = Arena(a, 4096)
    assert len(arena) == 2
    arena[1][:4] = b"\x00\x00\x80\x3f"  # 1.0f little-endian
    assert a[1, 0] == 1.0


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_arena_index_out_of_range(slot: int) -> None:
    arena = Arena.allocate(4, 4096)
    with pytest.raises(IndexError, match=f"slot {slot} out of range: arena has 4 slots"):
        arena[slot]


def test_arena_index_accepts_numpy_int() -> None:
    arena = Arena.allocate(2, 4096)
    assert len(arena[np.int32(1)]) == 4096


def test_arena_check_job() -> None:
    arena = Arena.allocate(4, 4096)
    arena.check_job(Job(1, (b"a", b"b"), (0, 3)))
    arena.check_job(Job(1, (), ()))
    with pytest.raises(IndexError, match="job 7: slot 4 out of range"):
        arena.check_job(Job(7, (b"a", b"b"), (0, 4)))
    with pytest.raises(IndexError, match="slot -1"):
        arena.check_job(Job(7, (b"a",), (-1,)))


# -- Namespace ---------------------------------------------------------------------

FIELDS = {"model": "m/ü", "dtype": "bfloat16", "tokens_per_chunk": 256, "tp": [1, 2], "seed": None}


def expected_digest(fields: dict) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def test_namespace_digest_is_sha256_of_canonical_json() -> None:
    ns = Namespace(FIELDS)
    assert ns.digest == expected_digest(FIELDS)
    assert len(ns.digest) == 16 and int(ns.digest, 16) >= 0
    # key order does not matter, values do
    assert Namespace(dict(reversed(list(FIELDS.items())))).digest == ns.digest
    assert Namespace({**FIELDS, "tp": [2, 1]}).digest != ns.digest
    assert Namespace().digest == hashlib.sha256(b"{}").hexdigest()[:16]


def test_namespace_rejects_non_dict_and_non_json_fields() -> None:
    with pytest.raises(TypeError, match="must be a dict"):
        Namespace([("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON-serialisable"):
        Namespace({"x": object()})


def test_namespace_document_round_trips() -> None:
    ns = Namespace(FIELDS)
    doc = ns.document()
    assert doc == {"kvtiers_namespace": 1, "digest": ns.digest, "fields": FIELDS}
    raw = ns.document_bytes()
    assert json.loads(raw) == doc
    ns.check_document(raw)
    ns.check_document(raw.decode())
    ns.check_document(doc)


def test_namespace_check_document_mismatches() -> None:
    ns = Namespace(FIELDS)
    other = Namespace({**FIELDS, "dtype": "float16"})
    with pytest.raises(ValueError, match=f"namespace {ns.digest} holds a different description"):
        ns.check_document(other.document_bytes())
    # same digest claimed, different fields: still refused
    forged = {**ns.document(), "fields": other.fields}
    with pytest.raises(ValueError, match="different description"):
        ns.check_document(forged)
    with pytest.raises(ValueError, match="not a namespace document"):
        ns.check_document(b"{nope", where="ns/config.json")
    with pytest.raises(ValueError, match="ns/config.json: not a kvtiers namespace document"):
        ns.check_document({"digest": ns.digest, "fields": FIELDS}, where="ns/config.json")
    with pytest.raises(ValueError, match="not a kvtiers namespace document"):
        ns.check_document(b"[1, 2]")


# -- TierContext -------------------------------------------------------------------


def test_tiercontext_defaults_and_type_check() -> None:
    arena = Arena.allocate(1, 4096)
    ctx = TierContext(arena)
    assert ctx.arena is arena
    assert ctx.namespace == Namespace({})
    with pytest.raises(TypeError, match="kvtiers.Arena"):
        TierContext(bytearray(4096))  # type: ignore[arg-type]


def test_tiercontext_removed_reaches_every_listener() -> None:
    got: list[tuple[str, tuple[bytes, ...], str]] = []
    ctx = TierContext(Arena.allocate(1, 4096), removed=lambda k, r: got.append(("first", k, r)))
    ctx.add_removed_listener(lambda k, r: got.append(("second", k, r)))
    ctx.removed(iter([b"a", b"b"]), "evicted")
    ctx.removed([], "evicted")  # nothing dropped: nothing reported
    assert got == [("first", (b"a", b"b"), "evicted"), ("second", (b"a", b"b"), "evicted")]


def test_tiercontext_removed_without_listeners_is_a_no_op() -> None:
    TierContext(Arena.allocate(1, 4096)).removed([b"a"], "gc")


def test_tiercontext_loop_is_the_running_io_loop() -> None:
    from kvtiers.ioloop import is_io_thread

    ctx = TierContext(Arena.allocate(1, 4096))
    loop = ctx.loop
    assert loop.is_running()
    import asyncio
    import threading

    async def where() -> threading.Thread:
        return threading.current_thread()

    thread = asyncio.run_coroutine_threadsafe(where(), loop).result(5)
    assert is_io_thread(thread)
    assert thread.name == "kvtiers-io"


def test_tiercontext_keeps_a_falsy_callable_sink() -> None:
    class Sink(list):  # empty, hence falsy, yet a perfectly good sink
        def __call__(self, keys, reason) -> None:
            self.append((keys, reason))

    sink = Sink()
    TierContext(Arena.allocate(1, 4096), removed=sink).removed([b"k"], "corrupt")
    assert sink == [((b"k",), "corrupt")]


def test_accept_job_names_each_caller_error() -> None:
    from collections import deque

    from kvtiers import accept_job
    from kvtiers.types import drain

    arena = Arena.allocate(2, 4096)
    job = Job(7, (b"a",), (1,))
    assert accept_job(job, arena) is job
    with pytest.raises(TypeError, match="expected a kvtiers.Job, got tuple"):
        accept_job((7, (b"a",), (1,)), arena)
    with pytest.raises(ValueError, match="job 7: tier is closed"):
        accept_job(job, arena, closed=True)
    with pytest.raises(IndexError, match="job 8: slot 2 out of range"):
        accept_job(Job(8, (b"a", b"b"), (0, 2)), arena)
    d = deque([1, 2, 3])
    assert drain(d) == [1, 2, 3] and not d and drain(d) == []
