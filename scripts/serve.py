"""A local HTTP endpoint for translation, and at / the attention explorer.

  python scripts/serve.py checkpoint=runs/demo/checkpoints/checkpoint_average_last5.pt port=8000
  curl -s localhost:8000/translate -H 'Content-Type: application/json' -d '{"text": ["Hello."], "nbest": 2}'

POST /translate takes JSON ({"text": [...]} and the search settings of translate.py); GET /health,
/metrics, /openapi.json; GET / the page. One model worker batches concurrent requests fairly. It
listens on 127.0.0.1 and answers Host names of the loopback unless told otherwise (host=0.0.0.0
allowed_hosts=[...]); SIGTERM or Ctrl-C drain it. Needs the serve extra: pip install -e ".[serve]".
"""

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from transformer.checkpoint import CheckpointError
from transformer.config import ConfigError, ServeConfig, app_defaults, from_dict
from transformer.utils.cli import exit_with_error, log_to_stderr

ConfigStore.instance().store(name="serve_defaults", node=app_defaults("serve"))  # every default


@hydra.main(config_path="../configs", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    log_to_stderr()
    try:
        from transformer.serving.server import serve
    except ImportError as error:  # the serve extra is not installed
        extra = "pip install -e '.[serve]' (uvicorn, starlette, prometheus-client)"
        exit_with_error(ImportError(f"serve.py needs {error.name}: {extra}"))
    try:
        serve(from_dict(ServeConfig, OmegaConf.to_container(cfg, resolve=True)))
    except (ConfigError, CheckpointError, OSError) as error:
        exit_with_error(error)


if __name__ == "__main__":
    main()
