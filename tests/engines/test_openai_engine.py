"""The openai engine against a real vLLM OpenAI-compatible server process on loopback."""

from __future__ import annotations

import copy
import http.server
import json
import threading

import httpx
import pytest
import torch
from conftest import published
from vllm_support import require_vllm

from decentrl.algo.logprobs import sequence_logprobs
from decentrl.engines.base import EngineUnavailable
from decentrl.engines.openai import NEUTRAL_SAMPLING, OpenAIEngine, ReloadRoute
from decentrl.protocol import SamplingParams

require_vllm()
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup(bpe_model, vllm_server, tmp_path_factory):
    engine = OpenAIEngine(vllm_server.url, bpe_model.model_dir, tmp_path_factory.mktemp("served"))
    prompts = [bpe_model.tokenizer(text)["input_ids"] for text in ["12+35=", "7+8=", "99+1="]]
    yield copy.deepcopy(bpe_model.model), engine, prompts
    engine.load_weights(published(bpe_model.model), 0)  # the server stays at version 0 for others
    engine.close()


def max_gap(model, prompts, completions, temperature: float) -> float:
    gaps = []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)
        trainer = logprobs[0, len(prompt) :].tolist()
        gaps += [abs(a - b) for a, b in zip(completion.logprobs, trainer, strict=True)]
    return max(gaps)


def test_the_server_samples_token_ids_with_the_trainers_logprobs(setup):
    model, engine, prompts = setup
    assert engine.route is ReloadRoute.VLLM
    engine.load_weights(published(model), 0)
    batch = [p for p in prompts for _ in range(4)]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=6)
    completions = engine.generate(batch, sampling, seed=1)
    assert len(completions) == len(batch)
    assert max_gap(model, batch, completions, 0.7) < 1e-4
    assert all(set(c.policy_versions) == {0} for c in completions)
    assert [c.token_ids for c in engine.generate(batch, sampling, seed=1)] == [
        c.token_ids for c in completions
    ]
    assert len({tuple(c.token_ids) for c in completions[:4]}) > 1, "the n samples of one prompt must differ"


def test_a_new_version_reaches_the_server_through_its_reload_route(setup):
    model, engine, prompts = setup
    engine.load_weights(published(model), 0)
    torch.manual_seed(1)
    state = model.state_dict()
    changed = {
        name: (state[name] + 0.3 * torch.randn_like(state[name])).to(torch.bfloat16)
        for name in ["model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"]
    }
    engine.update_weights(changed, 1)
    model.load_state_dict({name: tensor.float() for name, tensor in changed.items()}, strict=False)
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), seed=0)
    assert max_gap(model, prompts, greedy, 0.0) < 1e-4
    assert all(set(c.policy_versions) == {1} for c in greedy)


class ModelsOnly(http.server.BaseHTTPRequestHandler):
    """A server that lists a model and has no other route (no completions, no reload)."""

    def do_GET(self):
        body = b'{"data": [{"id": "tiny"}]}' if self.path == "/v1/models" else b"{}"
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_a_server_that_cannot_reload_is_refused(setup, tmp_path):
    model, engine, _ = setup
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ModelsOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EngineUnavailable, match="VLLM_SERVER_DEV_MODE=1"):
            OpenAIEngine(f"http://127.0.0.1:{server.server_port}", engine.model_dir, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(EngineUnavailable, match="no OpenAI-compatible server"):
        OpenAIEngine(f"http://127.0.0.1:{server.server_port}", engine.model_dir, tmp_path)


class DroppingProxy(http.server.BaseHTTPRequestHandler):
    """Forwards every request to the real server but drops one field from completions requests,
    as a server or gateway that does not know that field would."""

    upstream: str
    dropped: str

    def do_GET(self):
        self.forward(None)

    def do_POST(self):
        self.forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def forward(self, body: bytes | None) -> None:
        if body and self.path == "/v1/completions":
            request = json.loads(body)
            request.pop(self.dropped, None)
            body = json.dumps(request).encode()
        upstream = httpx.request(
            self.command,
            self.upstream + self.path,
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        self.send_response(upstream.status_code)
        self.send_header("Content-Length", str(len(upstream.content)))
        self.end_headers()
        self.wfile.write(upstream.content)

    def log_message(self, *args):
        pass


def test_every_request_names_the_neutral_sampling_fields(setup):
    _, engine, prompts = setup
    sent = []
    engine.http.event_hooks = {"request": [lambda request: sent.append(json.loads(request.content))]}
    try:
        engine.generate(prompts[:1], SamplingParams(temperature=0.7, max_new_tokens=2), seed=0)
    finally:
        engine.http.event_hooks = {}
    assert sent and all(body.items() >= NEUTRAL_SAMPLING.items() for body in sent)


@pytest.mark.parametrize("field", ["top_k", "top_p", "min_p", "repetition_penalty"])
def test_a_server_that_ignores_a_sampling_field_is_refused(setup, bpe_model, vllm_server, tmp_path, field):
    # without the field the server falls back to the model's generation_config.json (top_k 20,
    # top_p 0.8, repetition_penalty 1.05 here) or its own default; either way the probe sees it
    _, engine, _ = setup
    engine.load_weights(published(bpe_model.model), 0)  # the model the probes start from
    handler = type("Proxy", (DroppingProxy,), {"upstream": vllm_server.url, "dropped": field})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EngineUnavailable, match=f"ignores the request's `{field}`"):
            OpenAIEngine(f"http://127.0.0.1:{server.server_port}", engine.model_dir, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
