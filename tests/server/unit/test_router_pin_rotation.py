"""The `sluice-pin` key rotates without a restart (router/pin.py `rotate`, the router's
reload of `--pin-key-file`): new cookies are signed with the new key, cookies signed with the
key before stay honoured, older ones do not; a key file that cannot be used changes
nothing."""

from __future__ import annotations

import json

import pytest
from sluice_server.router.app import build_router
from sluice_server.router.pin import Pins
from sluice_server.settings import RouterSettings

MODEL = "team-a/chat"
FIRST, SECOND, THIRD = b"1" * 48, b"2" * 48, b"3" * 48


def test_a_rotation_keeps_the_key_before_and_only_that_one():
    pins = Pins(FIRST, 60)
    old = pins.sign(MODEL, "pod-a", now=1000)
    pins.rotate(SECOND)
    new = pins.sign(MODEL, "pod-b", now=1000)
    assert new != Pins(FIRST, 60).sign(MODEL, "pod-b", now=1000)  # signed with the new key
    assert pins.verify(old, MODEL, now=1001) == "pod-a"  # the key before: still honoured
    assert pins.verify(new, MODEL, now=1001) == "pod-b"
    pins.rotate(SECOND)  # the same key again (a touched file): nothing is forgotten
    assert pins.verify(old, MODEL, now=1001) == "pod-a"
    pins.rotate(THIRD)
    # Negative control: two rotations on, the first key is no longer honoured.
    assert pins.verify(old, MODEL, now=1001) is None
    assert pins.verify(new, MODEL, now=1001) == "pod-b"
    with pytest.raises(ValueError, match="32 bytes"):
        pins.rotate(b"short")
    assert pins.verify(new, MODEL, now=1001) == "pod-b"


def test_the_router_reloads_a_changed_key_file(tmp_path):
    models, key = tmp_path / "models.json", tmp_path / "pin-key"
    models.write_text(json.dumps({}))
    key.write_bytes(FIRST + b"\n")
    router = build_router(RouterSettings(models_file=models, pin_key_file=key))
    pins = router.pins
    assert pins is not None and pins.key == FIRST
    old = pins.sign(MODEL, "pod-a")
    router.reloader.check()
    assert pins.key == FIRST  # unchanged file: nothing read
    # The kubelet swaps the Secret's files in one rename.
    tmp = tmp_path / "pin-key.tmp"
    tmp.write_bytes(SECOND)
    tmp.replace(key)
    router.reloader.check()
    assert router.pins is pins and pins.key == SECOND
    assert pins.verify(old, MODEL) == "pod-a"
    # A key file that cannot be used (too short) is refused: the keys stay.
    tmp.write_bytes(b"short")
    tmp.replace(key)
    router.reloader.check()
    assert pins.key == SECOND and pins.verify(old, MODEL) == "pod-a"
    # Pin key reloads are not models-file reloads.
    assert router.metrics.reloads.labels("ok")._value.get() == 0
    assert router.metrics.reloads.labels("error")._value.get() == 0
