"""The README's rendered parts, one module per area; `specserve/bench/report.py` lists them and
writes or checks the README."""
