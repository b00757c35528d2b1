"""The embedded default: SmolLM2-135M-Instruct on chitchat data (see demo/run.py)."""
