import os

import pytest
import torch

from glmvit import VisionConfig
from glmvit.oracle import encoder_like, hf_vision_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


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
