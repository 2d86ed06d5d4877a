import os

import pytest
import torch

from glmvit import VisionConfig
from glmvit.testing import encoder_like, hf_vision_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`/`multigpu` tests without CUDA, and notebook cells tagged `gpu` (nbval) likewise."""
    gpus = torch.cuda.device_count() if has_cuda() else 0
    for item in items:
        cell = getattr(item, "cell", None)
        tags = cell.get("metadata", {}).get("tags", []) if cell is not None else []
        if ("gpu" in item.keywords or "gpu" in tags) and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture(scope="session")
def tiny_config():
    return VisionConfig.tiny()


@pytest.fixture(scope="session")
def tiny_hf(tiny_config):
    """transformers' Glm4vVisionModel (eager attention) with random non-trivial weights: the oracle."""
    return hf_vision_model(tiny_config, seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_hf, tiny_config):
    """Our encoder with the oracle's weights."""
    return encoder_like(tiny_hf, tiny_config)
