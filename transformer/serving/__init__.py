"""The local HTTP endpoint (`server.py`) and the attention explorer's static page (`static/`)."""
