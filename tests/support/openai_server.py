"""The in-process gateway with its OpenAI HTTP API on a free port (memsvc in process, the
model-free executor, the default model's tokenizer), for the HTTP API's integration tests;
tests/integration/conftest.py makes it the module fixture `server`."""
import time

import httpx
import openai

from pagedserve.gateway.openai.server import start_openai
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.server import Backend
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from tests.support.fake_executor import SlowExecutor
from tests.support.gateway_harness import GatewayThread, Serialized

BLOCK = 4


class Server:
    """A Gateway on its own loop thread with the OpenAI API beside it on a free port."""

    def __init__(self, tokenizer, num_blocks=256, delay=0.0, api_key=None, gate=None, max_num_seqs=32,
                 gateway_options=None, **options):
        """`gateway_options` go to the Gateway (reasoning_parser, served_model_name, ...),
        `options` to the OpenAI API (pagedserve.gateway.openai.app.OpenAIApi)."""
        self.executor = SlowExecutor(BLOCK, 2048, delay=delay)
        self.executor.info.vocab_size = len(tokenizer)  # outputs stay below 999, never EOS
        self.memory = Serialized(MemoryManager(MemoryConfig(num_blocks=num_blocks, max_model_len=2048)))
        self.executor.attach_pool(self.memory.register_executor(self.executor.info.kv))

        def connect():
            if gate is not None and not gate.wait(30):
                raise TimeoutError("gate")
            return Backend(self.memory, self.executor, tokenizer)

        self.g = GatewayThread(connect, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, overlap=False),
                               **(gateway_options or {}))
        self.http = self.g._call(start_openai(self.g.gateway, "127.0.0.1", 0, api_key, **options))
        self.url = f"http://127.0.0.1:{self.http.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0)

    def post(self, path, body, **kw):
        return httpx.post(self.url + path, json=body, **{"timeout": 30, **kw})

    def referenced(self) -> int:
        return self.memory.stats().snapshot["blocks_referenced"]

    def wait_unreferenced(self, timeout=10.0) -> int:
        deadline = time.monotonic() + timeout
        while (n := self.referenced()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return n

    def close(self):
        self.g._call(self.http.stop())
        self.g.close()
