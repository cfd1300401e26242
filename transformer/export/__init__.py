"""A trained checkpoint handed to the tools the field deploys with: a CTranslate2 model directory
(`ctranslate2.py`) and a Hugging Face `transformers` model directory (`huggingface.py`)."""
