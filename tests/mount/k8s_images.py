"""The images the k8s tests name: the user's (there is no default), pinned by digest."""

from __future__ import annotations

IMAGE = "registry.example.com/tools/modelpack@sha256:" + "cd" * 32
SERVING = "registry.example.com/tools/vllm-modelpack@sha256:" + "ef" * 32
_SERVING_COMMANDS = ("pod", "init-container", "inferenceservice")


def with_images(argv: list[str]) -> list[str]:
    """``argv`` of a ``k8s …`` command with ``--image SERVING`` added where it runs a server
    (the modelpack image comes from ``MODELPACK_IMAGE``, which the tests set)."""
    for i, arg in enumerate(argv[1:], 1):
        if arg in _SERVING_COMMANDS and argv[i - 1] in ("k8s", "kserve"):
            return [*argv, "--image", SERVING]
    return list(argv)
