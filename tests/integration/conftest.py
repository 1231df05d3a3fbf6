"""The integration tests' shared fixtures: the default model's tokenizer, and the in-process
gateway with its OpenAI HTTP API (tests.support.openai_server), one per module."""
import pytest

from tests.support.openai_server import Server


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from pagedserve.gateway.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def server(tokenizer):
    s = Server(tokenizer)
    s.g.wait_ready()
    yield s
    s.close()
