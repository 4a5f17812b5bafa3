"""Packing: a checkpoint directory (or S3 prefix) becomes a ModelPack artifact.

``packer`` (``build_artifact``: the steps in order), ``file_discovery`` (which files, which layer
kind), ``reshard`` (splitting oversized safetensors at tensor boundaries), ``model_config``
(config and manifest from config.json and headers), ``packed_artifact`` (the result, a read-only
Target), ``safetensors_format`` (strict header parsing and writing), ``image_format`` (the
image-shaped variant for containerd image volumes), ``s3_checkpoint`` (pack straight from objects
in a bucket).
"""
