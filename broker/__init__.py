"""The broker (`broker.state`, `broker.server`, `python -m broker`) and, in `broker.protocol`,
the wire protocol that every process speaks.

This file imports nothing: a client or a worker that imports `broker.protocol` must not load
the broker process with it (tests/test_layers.py checks).
"""
