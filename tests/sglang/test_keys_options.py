"""The SGLang backend's parts that need neither SGLang nor torch: options and key chains.

``PageChain`` must give a page exactly the kvd keys ``kvd_protocol.keys``
gives the same tokens as one sequence (that is what makes SGLang's chunks and
those of any kvd client of the same namespace one cache entry), forget nothing
it was not asked to, and never key a page whose ancestry it does not know.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from kvd_client.sglang.chain import PageChain, hash_page_keys, request_salt
from kvd_client.sglang.options import OPTIONS, Options
from kvd_protocol.keys import Namespace, chain_root, chunk_keys, namespace_digest

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"
NS = Namespace(model="tiny", kv_dtype="bfloat16", attention="mha", num_layers=3, kv_heads=2,
               head_dim=8, chunk_tokens=16)
DIGEST = namespace_digest(NS)


def _pages(tokens, size):
    return [tokens[i:i + size] for i in range(0, len(tokens), size)]


def _hashes(prefix, n):
    return [f"{prefix}{i:062x}" for i in range(n)]


def test_options_read_kvd_keys_and_leave_sglangs_alone():
    opts = Options.from_extra_config({"backend_name": "kvd", "interface_v1": 1, "allocator": "shm",
                                      "kvd_runtime_dir": "/run/kvd", "kvd_timeout_s": 2,
                                      "kvd_key_mode": "hashes", "kvd_staging_pages": 8})
    assert (opts.runtime_dir, opts.timeout_s, opts.key_mode, opts.staging_pages) == \
        ("/run/kvd", 2.0, "hashes", 8)
    assert Options.from_extra_config(None) == Options()
    assert set(OPTIONS) == set(Options.__dataclass_fields__)


def test_docs_list_every_option_with_its_type_and_default():
    rows = {m[0]: (m[1], m[2]) for m in
            re.findall(r"^\| `kvd_(\w+)` \| (\w+) \| `([^`]*)` \|", DOC.read_text(), re.M)}
    assert set(rows) == set(OPTIONS), sorted(set(rows) ^ set(OPTIONS))
    for name, opt in OPTIONS.items():
        assert rows[name] == (opt.type.__name__, json.dumps(opt.default)), name


@pytest.mark.parametrize("extra, words", [
    ({"kvd_runtime": "/x"}, "unknown kvd option 'kvd_runtime'"),
    ({"kvd_timeout_s": "5"}, "must be a float"),
    ({"kvd_staging_pages": 0}, "must be positive"),
    ({"kvd_staging_pages": True}, "must be a int"),
    ({"kvd_key_mode": "token"}, "must be one of"),
    ({"kvd_kv_dtype": "fp8"}, "must be one of"),
])
def test_options_refuse_typos_and_wrong_types(extra, words):
    with pytest.raises(ValueError, match=words):
        Options.from_extra_config(extra)


def test_chain_keys_pages_as_one_sequence():
    tokens = list(range(1000, 1128))  # 4 SGLang pages of 32 tokens = 8 kvd chunks of 16
    chain = PageChain(100)
    hashes = _hashes("a", 4)
    chain.record(None, None, hashes[:2], _pages(tokens[:64], 32))   # a node
    chain.record(hashes[1], None, hashes[2:], _pages(tokens[64:], 32))  # its child
    keyed = chain.page_keys(hashes, DIGEST, 16)
    expect = chunk_keys(chain_root(DIGEST), tokens, 16)
    assert [k for page in keyed for k in page] == expect
    # a query may start anywhere in the chain
    assert chain.page_keys(hashes[2:], DIGEST, 16) == keyed[2:]
    # another chunk size (a daemon restarted with it): keys follow
    assert [k for p in chain.page_keys(hashes, DIGEST, 32) for k in p] == \
        chunk_keys(chain_root(DIGEST), tokens, 32)


def test_chain_salt_starts_the_chain():
    tokens = list(range(64))
    chain = PageChain(100)
    chain.record(None, "request:t1", _hashes("b", 2), _pages(tokens, 32))
    keyed = chain.page_keys(_hashes("b", 2), DIGEST, 16)
    assert [k for p in keyed for k in p] == chunk_keys(chain_root(DIGEST, "request:t1"), tokens, 16)
    assert keyed[0][0] != chunk_keys(chain_root(DIGEST), tokens, 16)[0]


def test_chain_never_keys_an_unknown_page_or_ancestry():
    chain = PageChain(100)
    chain.record("f" * 64, None, _hashes("c", 2), _pages(list(range(64)), 32))  # parent unknown
    assert chain.page_keys(_hashes("c", 2), DIGEST, 16) == []
    assert chain.page_keys(["0" * 64], DIGEST, 16) == []
    chain.record(None, None, ["d" * 64], [list(range(24))])  # not whole chunks
    assert chain.page_keys(["d" * 64], DIGEST, 16) == []
    chain.record(None, None, ["e" * 64], [[2**32] * 16])  # not token ids kvd can hash
    assert chain.page_keys(["e" * 64], DIGEST, 16) == []


def test_chain_stops_at_the_first_unknown_page():
    chain = PageChain(100)
    hashes = _hashes("g", 3)
    chain.record(None, None, hashes, _pages(list(range(96)), 32))
    assert len(chain.page_keys([hashes[0], "9" * 64, hashes[2]], DIGEST, 16)) == 1


def test_chain_forgets_least_recently_used_pages_first():
    chain = PageChain(3)
    old, new = _hashes("h", 2), _hashes("i", 2)
    chain.record(None, None, old, _pages(list(range(64)), 32))
    chain.record(None, None, [new[0]], [list(range(100, 132))])
    assert chain.page_keys([old[0]], DIGEST, 16)  # used: now the newest
    chain.record(None, None, [new[1]], [list(range(200, 232))])
    assert (len(chain), chain.forgotten) == (3, 1)
    assert chain.page_keys([old[1]], DIGEST, 16) == []  # the least recently used went
    assert chain.page_keys([old[0]], DIGEST, 16)


def test_hash_mode_keys_are_per_page_and_namespace():
    keys = hash_page_keys(["ab" * 32, "cd" * 32, "not hex"], DIGEST, 2)
    assert len(keys) == 2 and all(len(k) == 2 and len(set(k)) == 2 for k in keys)
    other = namespace_digest(Namespace(model="other", kv_dtype="bfloat16", attention="mha",
                                       num_layers=3, kv_heads=2, head_dim=8, chunk_tokens=16))
    assert hash_page_keys(["ab" * 32], other, 2)[0] != keys[0]


def test_hash_mode_keys_carry_the_fixed_salt():
    """kvd_salt separates deployments in key_mode 'hashes' too."""
    plain = hash_page_keys(["ab" * 32], DIGEST, 2)
    assert hash_page_keys(["ab" * 32], DIGEST, 2, salt="") == plain
    a, b = (hash_page_keys(["ab" * 32], DIGEST, 2, salt=s) for s in ("tenant-a", "tenant-b"))
    assert len({plain[0], a[0], b[0]}) == 3 and not set(a[0]) & set(plain[0])


def test_request_salt_matches_the_vllm_connector():
    assert request_salt("", None, None) is None
    assert request_salt("", "t1", None) == "request:t1"  # vLLM: cache_salt -> "request:<salt>"
    assert request_salt("dep", "t1", "lora7") == "dep\x1frequest:t1\x1fextra_key:lora7"


def test_gil_switch_ms_sets_the_process_switch_interval_and_zero_leaves_it():
    before = sys.getswitchinterval()
    try:
        Options.from_extra_config({"kvd_gil_switch_ms": 0}).apply_process_settings()
        assert sys.getswitchinterval() == before
        Options.from_extra_config({"kvd_gil_switch_ms": 0.2}).apply_process_settings()
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        with pytest.raises(ValueError, match=">= 0"):
            Options.from_extra_config({"kvd_gil_switch_ms": -1.0})
    finally:
        sys.setswitchinterval(before)
