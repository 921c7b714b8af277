"""The router learns, per credential, the tenant a pod salts its caller's prompts with
(router/tenants.py): from the pod's answer only, never a key kept in clear."""

from __future__ import annotations

import hashlib

from sluice_server.router.tenants import TENANT_HEADER, UNKNOWN, Tenants, credential


def test_the_credential_is_read_as_the_pod_reads_it_and_kept_only_hashed():
    digest = hashlib.sha256(b"sk-a").digest()
    assert credential([(b"authorization", b"Bearer sk-a")]) == digest
    assert credential([(b"x-api-key", b"sk-a")]) == digest
    assert credential([], b"prompt=x&api_key=sk-a") == digest
    # Bearer first, as the pod does (services.api_key_of)
    assert credential([(b"x-api-key", b"other"), (b"authorization", b"Bearer sk-a")]) == digest
    assert credential([(b"authorization", b"Basic abc")]) is None
    assert credential([]) is None


def test_a_tenant_is_learned_from_an_accepted_answer_and_unknown_before():
    t = Tenants()
    cred = credential([(b"authorization", b"Bearer sk-a")])
    assert t.of(cred) is UNKNOWN
    t.learn(cred, 401, [(TENANT_HEADER, b"acme")])  # a refusal names nothing
    assert t.of(cred) is UNKNOWN
    t.learn(cred, 200, [(b"X-Sluice-Cache-Tenant", b"acme")])
    assert t.of(cred) == "acme"
    t.learn(cred, 200, [])  # auth off or sharing on now: no tenant salt
    assert t.of(cred) is None
    assert t.of(None) is None  # no credential: the anonymous caller


def test_the_memory_is_bounded_and_keeps_the_recent():
    t = Tenants(size=2)
    a, b, c = (hashlib.sha256(x).digest() for x in (b"a", b"b", b"c"))
    t.learn(a, 200, [(TENANT_HEADER, b"ta")])
    t.learn(b, 200, [(TENANT_HEADER, b"tb")])
    assert t.of(a) == "ta"  # a is now the most recent
    t.learn(c, 101, [(TENANT_HEADER, b"tc")])
    assert len(t) == 2 and t.of(b) is UNKNOWN and t.of(a) == "ta" and t.of(c) == "tc"
