"""Serving engines reading weights through modelpack: the vLLM load format `modelpack`."""
