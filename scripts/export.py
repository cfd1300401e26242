"""Export a trained checkpoint for deployment: a CTranslate2 model directory, or a Hugging Face
`transformers` directory (MarianMTModel and its tokenizer).

  python scripts/export.py checkpoint=runs/demo/checkpoints/checkpoint_average_last5.pt \
      format=ctranslate2 out=exported/demo_ct2 [quantization=int8]
  python scripts/export.py checkpoint=... format=huggingface out=exported/demo_hf

The directory appears only complete (written beside it, then renamed). Needs the optional packages:
pip install -e ".[export]".
"""

import os
import tempfile
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from transformer.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from transformer.config import ConfigError, ExportConfig, app_defaults, from_dict
from transformer.utils import atomic
from transformer.utils.cli import exit_with_error

ConfigStore.instance().store(name="export_defaults", node=app_defaults("export"))  # every default

USAGE = {
    "ctranslate2": "ctranslate2.Translator({out!r}).translate_batch([pieces]) (pieces: {out}/spm.model)",
    "huggingface": "transformers.MarianMTModel.from_pretrained({out!r}), MarianTokenizer likewise",
}


def export(cfg: ExportConfig) -> Path:
    out = Path(cfg.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out={cfg.out} exists and is not an empty directory; choose a new one")
    package = "ctranslate2" if cfg.format == "ctranslate2" else "transformers"
    try:
        __import__(package)
    except ImportError:
        raise ConfigError(f"format={cfg.format} needs {package}: pip install -e '.[export]'") from None
    ckpt = load_checkpoint(cfg.checkpoint)
    if not ckpt.get("spm_model"):
        raise CheckpointError(f"{cfg.checkpoint} carries no tokenizer (spm_model): an export takes it along")
    model = model_from_checkpoint(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        written = Path(tmp) / "model"
        if cfg.format == "ctranslate2":
            from transformer.export.ctranslate2 import export_ctranslate2

            export_ctranslate2(model, ckpt["spm_model"], written, cfg.quantization)
        else:
            from transformer.export.huggingface import export_huggingface

            export_huggingface(model, ckpt["spm_model"], written)
        if out.exists():
            out.rmdir()  # empty (checked above)
        atomic.rename(written, out)
    return out


@hydra.main(config_path="../configs", config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the network
    try:
        config = from_dict(ExportConfig, OmegaConf.to_container(cfg, resolve=True))
        out = export(config)
    except (ConfigError, CheckpointError, OSError, ValueError, RuntimeError) as error:  # the libraries' too
        exit_with_error(error)
    print(f"wrote {out} ({config.format}{', ' + config.quantization if config.quantization else ''})")
    print("use: " + USAGE[config.format].format(out=str(out)))


if __name__ == "__main__":
    main()
