"""Issue 58, row 8: what a runtime LoRA load may open (lora_checks.py), on real files: a weights file
symlinked outside --lora-allowed-root, a FIFO as adapter_config.json, files over the size cap, an
over-long name and a name that would take over a served model are each a 400 naming the field;
a plain adapter directory (with a symlink that stays inside the root) passes."""
from __future__ import annotations

import os

import pytest

from vllite_core.entrypoints.openai.errors import APIError
from vllite_core.entrypoints.openai.lora_checks import MAX_LORA_NAME_LEN, check_adapter_dir, check_lora_name


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "allowed"
    (r / "ok").mkdir(parents=True)
    (r / "ok" / "adapter_config.json").write_text("{}")
    (r / "ok" / "adapter_model.safetensors").write_bytes(b"x" * 100)
    (r / "shared.safetensors").write_bytes(b"y" * 10)
    os.symlink(r / "shared.safetensors", r / "ok" / "extra.safetensors")  # inside the root: fine
    (r / "ok" / "sub").mkdir()  # never read by the loader
    return r


def _refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_a_plain_adapter_passes(root):
    check_adapter_dir(str(root / "ok"), str(root))


def test_symlink_outside_the_root_is_refused(root, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s")
    os.symlink(secret, root / "ok" / "adapter_model.bin")
    e = _refused(check_adapter_dir, str(root / "ok"), str(root))
    assert e.param == "lora_path" and "outside" in e.message


def test_fifo_config_is_refused_without_opening_it(root):
    os.remove(root / "ok" / "adapter_config.json")
    os.mkfifo(root / "ok" / "adapter_config.json")  # opening it would block forever
    e = _refused(check_adapter_dir, str(root / "ok"), str(root))
    assert e.param == "lora_path" and "not a regular file" in e.message


def test_size_cap(root):
    with open(root / "ok" / "adapter_model.safetensors", "r+b") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    e = _refused(check_adapter_dir, str(root / "ok"), str(root))
    assert e.param == "lora_path" and "limit" in e.message
    check_adapter_dir(str(root / "ok"), str(root), 4 << 30)


def test_names(root):
    check_lora_name("mine", {"base"})
    assert _refused(check_lora_name, "x" * (MAX_LORA_NAME_LEN + 1), {"base"}).param == "lora_name"
    assert _refused(check_lora_name, "base", {"base", "alias"}).param == "lora_name"
    assert _refused(check_lora_name, "alias", {"base", "alias"}).param == "lora_name"
    assert _refused(check_lora_name, "", set()).param == "lora_name"
