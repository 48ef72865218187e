"""Key files: the several-key format, the one-key raw format, rotation, and their errors."""

from __future__ import annotations

import json
import os
import stat

import pytest

from splitserve.cli import build_parser, serve_worker_args
from splitserve.cli import main as cli_main
from splitserve.kvstore import DiskTier, add_key, drop_key, generate_key, load_keyring
from splitserve.kvstore.keyring import KeyRing, SealError, key_id


def raw_key_file(path, key: bytes = bytes(range(32))):
    """A key file in the one-key format: 32 raw bytes, mode 600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return path


def test_generate_writes_one_current_key_mode_600(tmp_path):
    path = generate_key(tmp_path / "kv.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ring = load_keyring(path)
    assert list(ring.keys) == [ring.current] and ring.keys[ring.current] == path.read_bytes()
    add_key(path)
    doc = json.loads(path.read_text())
    ring = load_keyring(path)
    assert doc["current"] == ring.current.hex() == key_id(ring.keys[ring.current]).hex()
    with pytest.raises(ValueError, match="already exists"):
        generate_key(path)


def test_one_key_raw_file_still_reads(tmp_path):
    ring = load_keyring(raw_key_file(tmp_path / "kv.key"))
    assert ring.keys == {key_id(bytes(range(32))): bytes(range(32))}


def test_rotate_adds_a_current_key_and_keeps_the_old_one(tmp_path):
    path = raw_key_file(tmp_path / "kv.key")
    old = load_keyring(path).current
    new = add_key(path)
    ring = load_keyring(path)
    assert ring.current == new != old and set(ring.keys) == {old, new}
    assert ring.keys[old] == bytes(range(32))  # the raw file became the JSON format
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="is the current key"):
        drop_key(path, new.hex())
    drop_key(path, old.hex())
    assert list(load_keyring(path).keys) == [new]
    with pytest.raises(ValueError, match="holds no key"):
        drop_key(path, old.hex())


def test_a_ring_opens_blocks_of_every_key_it_holds():
    a, b = bytes(32), bytes([1]) * 32
    sealed_by_a = KeyRing.of(a).seal(bytes(12), b"kv", b"aad")
    both = KeyRing.of(b, a)
    assert both.open(key_id(a), bytes(12), sealed_by_a, b"aad") == b"kv"
    with pytest.raises(SealError) as e:
        KeyRing.of(b).open(key_id(a), bytes(12), sealed_by_a, b"aad")
    assert e.value.missing_key
    with pytest.raises(SealError) as e:
        both.open(key_id(a), bytes(12), sealed_by_a, b"other aad")
    assert not e.value.missing_key


@pytest.mark.parametrize(
    ("content", "mode", "match"),
    [
        (None, 0o600, "does not exist"),
        (b"x" * 31, 0o600, "neither 32 raw bytes nor a splitserve key file"),
        (b"x" * 32, 0o644, "accessible by others"),
        (b'{"splitserve_kv_keys": 1, "current": "00", "keys": {}}', 0o600, "16 hex digits"),
        (b'{"splitserve_kv_keys": 1, "current": "0000000000000000", "keys": {}}', 0o600,
         "not among the keys"),
        (json.dumps({"splitserve_kv_keys": 1, "current": "0000000000000000",
                     "keys": {"0000000000000000": "00" * 32}}).encode(), 0o600,
         "does not match its key"),
        (b'{"keys": {}}', 0o600, "splitserve_kv_keys"),
    ],
)  # fmt: skip
def test_bad_key_files_are_clear_errors(tmp_path, content, mode, match):
    path = tmp_path / "kv.key"
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    with pytest.raises(ValueError, match=match):
        load_keyring(path)


def one_line_error(capsys, argv: list[str]) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_host_encrypt_without_a_key_is_a_one_line_error(capsys, command):
    err = one_line_error(capsys, [command, "--host-kv-gb", "0.01", "--host-kv-encrypt"])
    assert "--host-kv-encrypt needs" in err and "--kv-encryption-key-file" in err


def test_worker_with_a_bad_key_file_is_a_one_line_error(capsys, tmp_path):
    bad = tmp_path / "kv.key"
    bad.write_bytes(b"{not json")
    bad.chmod(0o600)
    argv = ["worker", "--host-kv-gb", "0.01", "--host-kv-encrypt"]
    err = one_line_error(capsys, [*argv, "--kv-encryption-key-file", str(bad)])
    assert "is neither 32 raw bytes nor a splitserve key file" in err


def test_kv_commands_rotate_list_and_drop(capsys, tmp_path):
    path = str(raw_key_file(tmp_path / "kv.key"))
    old = load_keyring(path).current.hex()
    assert cli_main(["kv", "rotate", path]) == 0
    new = load_keyring(path).current.hex()
    capsys.readouterr()
    assert cli_main(["kv", "keys", path]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == sorted([old, f"{new}  current"])
    assert "is the current key" in one_line_error(capsys, ["kv", "drop-key", path, new])
    assert "16 hex digits" in one_line_error(capsys, ["kv", "drop-key", path, "zz"])
    assert cli_main(["kv", "drop-key", path, old]) == 0
    assert list(load_keyring(path).keys) == [bytes.fromhex(new)]


def test_reencrypt_of_a_missing_or_parent_directory_is_a_one_line_error(capsys, tmp_path):
    key = str(generate_key(tmp_path / "kv.key"))
    argv = ["kv", "reencrypt", str(tmp_path / "nope"), "--kv-encryption-key-file", key]
    assert "is not a directory" in one_line_error(capsys, argv)
    DiskTier(tmp_path / "kv" / "decode-0", 1 << 20, "m").put(bytes(16), b"x")
    argv[2] = str(tmp_path / "kv")  # serve's --disk-kv-dir: a directory per pool worker
    assert "its subdirectories do" in one_line_error(capsys, argv)
    argv[2] = str(tmp_path / "kv" / "decode-0")
    assert cli_main(argv) == 0 and "1 blocks re-sealed" in capsys.readouterr().out


def test_serve_passes_host_kv_encrypt_to_its_workers(tmp_path):
    key = str(generate_key(tmp_path / "kv.key"))
    tiers = ["--host-kv-gb", "1", "--host-kv-encrypt", "--kv-encryption-key-file", key]
    passed = serve_worker_args(build_parser().parse_args(["serve", *tiers]))
    worker = build_parser().parse_args(["worker", *passed])
    assert worker.host_kv_encrypt and worker.kv_encryption_key_file == key
    plain = serve_worker_args(build_parser().parse_args(["serve", "--host-kv-gb", "1"]))
    assert not build_parser().parse_args(["worker", *plain]).host_kv_encrypt
