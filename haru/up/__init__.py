"""Compositions on top: `haru up` (the whole control plane and the demo on one machine), `haru
serve` (a one-domain fleet from `--model` flags) and `haru convert` (a Hugging Face model to GGUF).
The only layer besides the CLI that may import the services (agents, gateway, projections).
"""
