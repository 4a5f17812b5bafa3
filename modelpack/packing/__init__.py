"""Packing: a checkpoint directory (or S3 prefix) becomes a ModelPack artifact.

``packer`` (files → layers, config, manifest), ``safetensors_format`` (strict header parsing and
re-sharding), ``image_format`` (the image-shaped variant for containerd image volumes),
``s3_checkpoint`` (pack straight from objects in a bucket).
"""
