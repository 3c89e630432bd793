"""Chunk keys: the test vectors of docs/protocol.md, and the properties keys must have.

The vectors are parsed out of the ``json`` block that follows the
``<!-- key-test-vectors -->`` marker in docs/protocol.md, so the document
and the code cannot drift apart. ``spec_*`` below re-implement the key spec
from the document's prose (struct packing and xxh3 only, nothing from
kvd_protocol.keys), which checks that the prose describes what the code does.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvd_protocol.keys import (
    KEY_BYTES,
    Namespace,
    chain_root,
    chunk_keys,
    namespace_digest,
    part_key,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
MARKER = "<!-- key-test-vectors -->"


def load_vectors(marker: str = MARKER) -> list[dict]:
    text = DOC.read_text(encoding="utf-8")
    assert text.count(marker) == 1, f"{DOC} must hold exactly one {marker}"
    m = re.match(r"\s*```json\n(.*?)\n```", text.split(marker, 1)[1], re.S)
    assert m, f"a ```json fenced block must follow {marker} in {DOC}"
    return json.loads(m.group(1))


VECTORS = load_vectors()
PART_MARKER = "<!-- part-key-test-vectors -->"
BY_NAME = {v["name"]: v for v in VECTORS}


# ---- the spec, re-implemented from docs/protocol.md §8 -------------------------

def spec_h(data: bytes) -> bytes:
    return xxhash.xxh3_128_intdigest(data, seed=0).to_bytes(16, "big")


def spec_ns_bytes(ns: dict) -> bytes:
    text = (ns["model"].encode("utf-8") + b"\x00" + ns["kv_dtype"].encode("ascii") + b"\x00"
            + ns["attention"].encode("ascii"))
    tp = 1 if ns["attention"] == "mla" else ns["tp_size"]
    fp = ns["fingerprint"].encode("utf-8")
    return (b"kvd-ns\x00" + struct.pack("<I", 2) + struct.pack("<I", len(text)) + text
            + b"".join(struct.pack("<I", ns[k]) for k in ("num_layers", "kv_heads", "head_dim",
                                                          "chunk_tokens")) + struct.pack("<I", tp)
            + struct.pack("<I", ns["first_layer"]) + struct.pack("<I", len(fp)) + fp)


def spec_keys(ns: dict, salt, tokens: list[int]) -> tuple[bytes, bytes, list[bytes]]:
    digest = spec_h(spec_ns_bytes(ns))
    root = spec_h(digest + b"salt" + salt.encode("utf-8")) if salt else digest
    c = ns["chunk_tokens"]
    keys, prev = [], root
    for i in range(len(tokens) // c):
        prev = spec_h(prev + b"".join(struct.pack("<I", t) for t in tokens[i * c:(i + 1) * c]))
        keys.append(prev)
    return digest, root, keys


# ---- vectors --------------------------------------------------------------------

def test_vector_block_covers_the_required_cases():
    names = set(BY_NAME)
    assert len(names) == len(VECTORS), "vector names must be unique"
    for v in VECTORS:
        assert set(v) == {"name", "namespace", "salt", "tokens", "namespace_bytes",
                          "namespace_digest", "root", "keys"}
    basic = BY_NAME["mha-tp1-two-chunks"]
    assert basic["namespace"]["attention"] == "mha" and basic["namespace"]["tp_size"] == 1
    assert basic["tokens"] == list(range(32)) and basic["namespace"]["chunk_tokens"] == 16
    assert len(basic["keys"]) == 2
    salted = BY_NAME["mha-tp1-salted"]
    assert salted["salt"] and salted["namespace"] == basic["namespace"]
    assert salted["tokens"] == basic["tokens"]
    assert max(BY_NAME["mha-tp1-high-token-ids"]["tokens"]) == 2**32 - 1
    mla1, mla4 = BY_NAME["mla-tp1"], BY_NAME["mla-tp4-equals-tp1"]
    assert mla1["namespace"]["tp_size"] == 1 and mla4["namespace"]["tp_size"] == 4
    assert {**mla4["namespace"], "tp_size": 1} == mla1["namespace"]
    stage0, stage1 = BY_NAME["pp-stage0-of-2"], BY_NAME["pp-stage1-of-2"]
    assert {**stage0["namespace"], "first_layer": 16} == stage1["namespace"]
    assert stage0["namespace"]["num_layers"] == 16 and stage0["tokens"] == basic["tokens"]
    assert {**BY_NAME["fingerprinted"]["namespace"], "fingerprint": ""} == basic["namespace"]
    assert all(set(v["namespace"]) >= {"first_layer", "fingerprint"} for v in VECTORS)
    partial = BY_NAME["mha-tp1-partial-trailing-chunk"]
    assert len(partial["tokens"]) % partial["namespace"]["chunk_tokens"]
    assert BY_NAME["mha-tp1-shorter-than-one-chunk"]["keys"] == []


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_kvd_keys_reproduces_vector(vec):
    ns = Namespace(**vec["namespace"])
    assert ns.encode().hex() == vec["namespace_bytes"]
    digest = namespace_digest(ns)
    assert digest.hex() == vec["namespace_digest"]
    root = chain_root(digest, vec["salt"])
    assert root.hex() == vec["root"]
    keys = chunk_keys(root, vec["tokens"], ns.chunk_tokens)
    assert [k.hex() for k in keys] == vec["keys"]
    assert len(keys) == len(vec["tokens"]) // ns.chunk_tokens
    # numpy input of any integer dtype gives the same keys as a list
    for dtype in (np.uint32, np.int64, np.uint64):
        assert chunk_keys(root, np.array(vec["tokens"], dtype=dtype), ns.chunk_tokens) == keys


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_prose_spec_reproduces_vector(vec):
    assert spec_ns_bytes(vec["namespace"]).hex() == vec["namespace_bytes"]
    digest, root, keys = spec_keys(vec["namespace"], vec["salt"], vec["tokens"])
    assert digest.hex() == vec["namespace_digest"]
    assert root.hex() == vec["root"]
    assert [k.hex() for k in keys] == vec["keys"]


def test_vector_relations():
    base = BY_NAME["mha-tp1-two-chunks"]
    assert BY_NAME["mha-tp1-salted"]["keys"][0] != base["keys"][0]
    assert BY_NAME["mha-tp1-empty-salt-is-no-salt"]["keys"] == base["keys"]
    assert BY_NAME["mha-tp1-partial-trailing-chunk"]["keys"] == base["keys"]
    assert BY_NAME["mha-tp2-shard"]["namespace_digest"] != base["namespace_digest"]
    mla1, mla4 = BY_NAME["mla-tp1"], BY_NAME["mla-tp4-equals-tp1"]
    for field in ("namespace_bytes", "namespace_digest", "root", "keys"):
        assert mla1[field] == mla4[field]
    stage0, stage1 = BY_NAME["pp-stage0-of-2"], BY_NAME["pp-stage1-of-2"]
    assert stage0["namespace_digest"] != stage1["namespace_digest"]
    assert not set(stage0["keys"]) & set(stage1["keys"])
    assert BY_NAME["fingerprinted"]["namespace_digest"] != base["namespace_digest"]


def test_doc_byte_example_matches_code():
    ns = Namespace("tiny", "float32", "mha", 2, 1, 4, 4, 1)
    text = DOC.read_text(encoding="utf-8")
    words = ns.encode().hex(" ", -4).split()
    assert " ".join(words[:8]) in text and " ".join(words[8:]) in text


# ---- properties -----------------------------------------------------------------

NS = Namespace(model="org/model", kv_dtype="float16", attention="mha", num_layers=4,
               kv_heads=2, head_dim=8, chunk_tokens=8, tp_size=1)


def _keys(ns=NS, tokens=None, salt=None):
    tokens = list(range(5 * ns.chunk_tokens)) if tokens is None else tokens
    return chunk_keys(chain_root(namespace_digest(ns), salt), tokens, ns.chunk_tokens)


def test_keys_are_16_bytes_and_digest_is_canonical_xxh3():
    enc = NS.encode()
    assert namespace_digest(NS) == xxhash.xxh3_128_intdigest(enc).to_bytes(16, "big")
    assert all(len(k) == KEY_BYTES == 16 for k in _keys())


def test_prefix_property():
    rng = random.Random(1)
    c = NS.chunk_tokens
    tokens = [rng.randrange(2**32) for _ in range(6 * c)]
    base = _keys(tokens=tokens)
    assert len(base) == 6 and len(set(base)) == 6
    for k in range(6):
        for pos in (k * c, k * c + rng.randrange(c), (k + 1) * c - 1):
            changed = list(tokens)
            changed[pos] = (changed[pos] + 1) % 2**32
            keys = _keys(tokens=changed)
            assert keys[:k] == base[:k], f"token {pos} of chunk {k} changed an earlier key"
            for j in range(k, 6):
                assert keys[j] != base[j], f"token {pos} of chunk {k} left key {j} unchanged"
    # keys of a prefix are the prefix of the keys; trailing partial chunks are ignored
    for n in range(len(tokens) + 1):
        assert _keys(tokens=tokens[:n]) == base[:n // c]


def test_chunk_order_matters():
    c = NS.chunk_tokens
    a, b = list(range(c)), list(range(100, 100 + c))
    assert _keys(tokens=a + b)[1] != _keys(tokens=b + a)[1]


def test_salt_isolation():
    tokens = list(range(3 * NS.chunk_tokens))
    plain = _keys(tokens=tokens)
    assert _keys(tokens=tokens, salt="") == plain
    assert _keys(tokens=tokens, salt=None) == plain
    seen = {tuple(plain)}
    for salt in ("a", "b", "tenant-1", "tenant-10", "ä", " a", "a\0"):
        keys = _keys(tokens=tokens, salt=salt)
        assert not set(keys) & set(plain), f"salt {salt!r} shares a key with no salt"
        assert tuple(keys) not in seen
        seen.add(tuple(keys))
    digest = namespace_digest(NS)
    assert chain_root(digest, "x") == xxhash.xxh3_128_digest(digest + b"saltx")


@pytest.mark.parametrize("change", [
    {"model": "org/model-2"}, {"model": "org/Model"}, {"kv_dtype": "bfloat16"},
    {"kv_dtype": "float8_e4m3fn"}, {"attention": "mla", "kv_heads": 1}, {"attention": "opaque"},
    {"num_layers": 5},
    {"kv_heads": 1}, {"kv_heads": 3}, {"head_dim": 16}, {"chunk_tokens": 16}, {"tp_size": 2},
    {"first_layer": 4}, {"first_layer": 1}, {"fingerprint": "lora:a"}, {"fingerprint": "\0"},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_namespace_isolation(change):
    other = replace(NS, **change)
    assert other.encode() != NS.encode()
    assert namespace_digest(other) != namespace_digest(NS)
    tokens = list(range(16))
    assert not set(_keys(other, tokens)) & set(_keys(NS, tokens))


def test_every_namespace_field_is_covered():
    fields = set(asdict(NS))
    assert fields == {"model", "kv_dtype", "attention", "num_layers", "kv_heads", "head_dim",
                      "chunk_tokens", "tp_size", "first_layer", "fingerprint"}


def test_model_text_is_unambiguous():
    # NUL bytes inside the model name cannot imitate other fields
    a = replace(NS, model="m\0float16")
    b = replace(NS, model="m")
    assert namespace_digest(a) != namespace_digest(b)


def test_fingerprint_is_unambiguous():
    # length-prefixed: no fingerprint can imitate another one followed by other bytes
    a, b = replace(NS, fingerprint="ab"), replace(NS, fingerprint="a")
    assert namespace_digest(a) != namespace_digest(b)
    assert namespace_digest(replace(NS, model="m", fingerprint="x")) != \
        namespace_digest(replace(NS, model="mx", fingerprint=""))


def test_mla_digest_ignores_tp_size():
    mla = Namespace("org/mla", "bfloat16", "mla", 61, 1, 576, 16, tp_size=1)
    digests = {namespace_digest(replace(mla, tp_size=tp)) for tp in (1, 2, 4, 8, 16, 64)}
    assert len(digests) == 1
    assert replace(mla, tp_size=8).shards == 1 and replace(mla, tp_size=8).planes == 1


def test_opaque_pages_one_plane_one_shard_per_rank():
    opaque = replace(NS, attention="opaque", head_dim=16)  # K and V of a head in one row
    assert opaque.planes == 1 and opaque.row_bytes == 2 * 16 * 2
    assert replace(opaque, tp_size=4).shards == 4
    assert len({namespace_digest(replace(opaque, tp_size=tp)) for tp in (1, 2, 4)}) == 3
    with pytest.raises(ValueError, match="attention"):
        replace(NS, attention="paged")


def test_mha_digest_depends_on_tp_size():
    digests = {namespace_digest(replace(NS, tp_size=tp)) for tp in (1, 2, 4, 8, 16)}
    assert len(digests) == 5
    assert replace(NS, tp_size=4).shards == 4 and NS.planes == 2


@pytest.mark.parametrize("tokens", [[-1], [2**32], [2**40], [0, 1, 2**32 + 5]],
                         ids=["negative", "2**32", "2**40", "one-bad-among-good"])
def test_token_range_is_validated(tokens):
    root = namespace_digest(NS)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        chunk_keys(root, tokens * NS.chunk_tokens, NS.chunk_tokens)


def test_token_range_checks_the_partial_tail_too():
    # a bad id in the ignored trailing tokens is still an error, never silently dropped
    with pytest.raises(ValueError):
        chunk_keys(namespace_digest(NS), [0] * NS.chunk_tokens + [-1], NS.chunk_tokens)


def test_token_range_bounds_are_inclusive_exclusive():
    root = namespace_digest(NS)
    assert len(chunk_keys(root, [0, 2**32 - 1] * 4, 8)) == 1
    with pytest.raises(ValueError):
        chunk_keys(root, [[0] * 8], 8)  # 2-d input
    assert chunk_keys(root, [], 8) == []


def test_huge_token_id_raises_value_error():
    with pytest.raises(ValueError):
        chunk_keys(namespace_digest(NS), [2**64] * 8, 8)


def test_float_token_ids_are_refused():
    with pytest.raises(ValueError):
        chunk_keys(namespace_digest(NS), [0.5] * 8, 8)


@pytest.mark.parametrize("bad", [
    {"model": ""}, {"model": "x" * 513}, {"model": "é" * 257}, {"kv_dtype": "fp16"},
    {"attention": "gqa"}, {"num_layers": 0}, {"kv_heads": 0}, {"head_dim": 2**31},
    {"chunk_tokens": 0}, {"tp_size": 0}, {"attention": "mla", "kv_heads": 2},
    {"tp_size": 65}, {"tp_size": 2**31 - 1}, {"num_layers": 1025}, {"kv_heads": 257},
    {"head_dim": 1025}, {"chunk_tokens": 8193}, {"first_layer": -1},
    {"first_layer": 1021}, {"fingerprint": "f" * 513}, {"fingerprint": None},
], ids=lambda c: ",".join(f"{k}={str(v)[:8]}" for k, v in c.items()))
def test_namespace_validation(bad):
    with pytest.raises(ValueError):
        replace(NS, **bad)


def test_namespace_limits_accepted():
    top = dict(model="x" * 512, num_layers=1024, kv_heads=256, head_dim=1024, chunk_tokens=8192,
               tp_size=64, fingerprint="f" * 512)
    ns = replace(NS, **top)
    assert {k: getattr(ns, k) for k in top} == top
    assert len(namespace_digest(ns)) == 16 and namespace_digest(ns) != namespace_digest(NS)
    last = replace(NS, num_layers=4, first_layer=1020)
    assert (last.num_layers, last.first_layer) == (4, 1020)


_CHILD = """
import json, sys
from kvd_protocol.keys import Namespace, chain_root, chunk_keys, namespace_digest
out = []
for v in json.loads(sys.stdin.read()):
    ns = Namespace(**v["namespace"])
    root = chain_root(namespace_digest(ns), v["salt"])
    out.append([k.hex() for k in chunk_keys(root, v["tokens"], ns.chunk_tokens)])
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", ["0", "1", "4242"])
def test_deterministic_across_processes(seed):
    rng = random.Random(int(seed))
    cases = [{"namespace": asdict(NS), "salt": "s" + seed,
              "tokens": [rng.randrange(2**32) for _ in range(4 * NS.chunk_tokens + 3)]},
             *({k: v[k] for k in ("namespace", "salt", "tokens")} for v in VECTORS)]
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(cases), env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(proc.stdout)
    expect = [[k.hex() for k in chunk_keys(chain_root(namespace_digest(Namespace(**c["namespace"])),
                                                      c["salt"]), c["tokens"],
                                           c["namespace"]["chunk_tokens"])] for c in cases]
    assert got == expect
    assert got[1:] == [v["keys"] for v in VECTORS]


# ---- partial chunk keys (docs/protocol.md §8.5) -----------------------------------

PART_VECTORS = load_vectors(PART_MARKER)
PART_SEED_SPEC = int.from_bytes(b"kvd-part", "little")  # 0x747261702d64766b, from the prose


def spec_part_key(prev: bytes, tokens: list[int]) -> bytes:
    data = prev + struct.pack("<I", len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens)
    return xxhash.xxh3_128_intdigest(data, seed=PART_SEED_SPEC).to_bytes(16, "big")


@pytest.mark.parametrize("vec", PART_VECTORS, ids=[v["name"] for v in PART_VECTORS])
def test_part_key_vectors(vec):
    prev = bytes.fromhex(vec["prev"])
    assert part_key(prev, vec["tokens"]).hex() == vec["key"]
    assert spec_part_key(prev, vec["tokens"]).hex() == vec["key"]
    assert PART_SEED_SPEC == 0x747261702D64766B


def test_part_keys_chain_on_the_whole_chunks_and_never_equal_a_chunk_key():
    base = BY_NAME["mha-tp1-two-chunks"]
    root, keys = bytes.fromhex(base["root"]), [bytes.fromhex(k) for k in base["keys"]]
    by_prev = {v["prev"] for v in PART_VECTORS}
    assert by_prev == {base["root"], base["keys"][0]}
    toks = base["tokens"]
    parts = {part_key(prev, toks[i * 16:i * 16 + n]) for i, prev in enumerate([root, keys[0]])
             for n in range(1, 16)}
    assert len(parts) == 30 and not parts & set(keys)
    # a chunk whose first words spell the length and the would-be tag is still another key
    assert part_key(root, toks[:14]) != chunk_keys(root, [14, *toks[:14], 0], 16)[0]
    assert part_key(keys[0], toks[16:24]) != part_key(root, toks[16:24])  # chained on prev
    with pytest.raises(ValueError):
        part_key(root, [])
    with pytest.raises(ValueError):
        part_key(root, [2**32])
