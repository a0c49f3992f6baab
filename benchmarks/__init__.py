"""Experiments, ablations and the documents' renderer: not installed with specserve (see cli.py)."""
