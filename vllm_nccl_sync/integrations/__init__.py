"""Thin front doors onto the two sides: vLLM (worker extension, weight-transfer backend), SGLang, verl."""
